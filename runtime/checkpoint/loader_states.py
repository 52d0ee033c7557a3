"""Loading energon loader states from a checkpoint without running arbitrary code.

energon's loader state is a tree of pickled objects (``torch.load(weights_only=True)`` refuses
it), and a plain ``pickle.loads`` of a file from disk would import and call whatever the file
names. This unpickler resolves only the globals a real energon state contains (found by
recording every ``find_class`` while loading states of loaders with 0 and 2 workers, with and
without packing) and refuses anything else with an error naming the global.

One of them, ``torch.storage._load_from_bytes``, is itself an unrestricted ``torch.load``; it is
replaced by a ``weights_only=True`` load, which is all a pickled RNG-state tensor needs.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from sft_runtime.runtime.errors import UserInputError

#: The globals an energon 7.4 loader state needs (module, name).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("collections", "OrderedDict"),
        ("megatron.energon.flavors.webdataset.sample_loader", "SliceState"),
        ("megatron.energon.rng", "SystemRngState"),
        ("megatron.energon.savable_loader", "SavableDataLoaderState"),
        ("megatron.energon.savable_loader", "SavableDatasetCheckpoint"),
        ("megatron.energon.savable_loader", "SavableDatasetState"),
        ("megatron.energon.state", "FlexState"),
        ("numpy", "dtype"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.numeric", "_frombuffer"),
        ("torch._utils", "_rebuild_tensor_v2"),
    }
)
_TORCH_STORAGE_LOADER = ("torch.storage", "_load_from_bytes")
_FORMAT = "sft_v2_loader_states"
_VERSION = 2  # 2: each state pickled on its own (the controller never unpickles them)


class UnsafePickleError(UserInputError):
    """A pickle names a global outside the allow-list (or is not a loader-state file)."""


def _load_storage_weights_only(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _TORCH_STORAGE_LOADER:
            return _load_storage_weights_only
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"refusing to unpickle global {module}.{name}: not one of the classes an energon "
                "loader state contains (the file is damaged or was not written by this runtime)"
            )
        return super().find_class(module, name)


def safe_loads(data: bytes) -> Any:
    """Unpickle `data`, resolving only allow-listed globals."""
    try:
        return _AllowListUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # truncated or corrupt input: say so, never a raw traceback
        raise UnsafePickleError(f"cannot read loader states: {type(exc).__name__}: {exc}") from exc


def dump_loader_state(state: dict) -> bytes:
    """One rank's state as bytes: made in the worker that owns the loader, so the process
    that writes the checkpoint never needs energon's classes."""
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def dumps_loader_states(states: list) -> bytes:
    """Serialize one state per logical DP rank (dicts from `ColocatedLoader.state_dict`, or
    bytes from `dump_loader_state`)."""
    blobs = [s if isinstance(s, bytes) else dump_loader_state(s) for s in states]
    payload = {"format": _FORMAT, "version": _VERSION, "states": blobs}
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def loader_state_blobs(data: bytes) -> list[bytes]:
    """The per-rank state blobs of a loader-states file, checked to unpickle safely."""
    payload = safe_loads(data)
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise UnsafePickleError("not a loader-states file (missing format marker)")
    if payload.get("version") != _VERSION:
        raise UnsafePickleError(
            f"loader-states version {payload.get('version')!r} is not supported (expected "
            f"{_VERSION})"
        )
    blobs = payload.get("states")
    if not isinstance(blobs, list) or not all(isinstance(b, bytes) for b in blobs):
        raise UnsafePickleError("loader-states file has no list of per-rank states")
    for blob in blobs:
        safe_loads(blob)  # refuse a crafted state here, before any worker sees it
    return blobs


def loads_loader_states(data: bytes) -> list:
    """Inverse of `dumps_loader_states`, through the allow-list unpickler."""
    return [safe_loads(blob) for blob in loader_state_blobs(data)]


def load_loader_state(state: dict | bytes | None) -> dict | None:
    """A restored state as the loader wants it (blobs go through the allow-list)."""
    return safe_loads(state) if isinstance(state, bytes) else state

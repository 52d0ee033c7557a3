"""Durable checkpoint files of a policy worker: weights, optimizer, per-rank RNG.

Layout under the paths the controller passes (``<step_dir>/policy/...``):

- ``weights/`` - ``model.safetensors`` (or shards and their index, past a size limit) under
  the model's own parameter names, written by rank 0 only (replicas are bitwise identical);
  with a Hugging Face model also ``config.json`` and ``generation_config.json``, so the
  folder is a model folder `from_pretrained` loads.
- ``optimizer/optimizer.pt`` - AdamW state + schedule step, by rank ``1 % world_size`` (so
  it is written beside rank 0's weights); loads with ``torch.load(weights_only=True)``.
- ``rng/rank_<r>.pt`` - python, numpy and torch RNG states and the torch thread count of
  rank r, written by every rank: the thread count changes float results, so a resume that
  must be bitwise exact refuses a different one.

Every file goes to a temporary name and is then `os.replace`d, so a crash never leaves a
half-written file under the final name; the bytes go past the page cache where the
filesystem allows it (`direct_io`: on a VM, fresh page-cache pages cost the writer more CPU
than the rest of the save). Each file is fsynced once: here, with its
directory, or (``fsync=False``) by whoever makes the whole folder durable before it counts,
as the controller does with a checkpoint written beside the next steps (`fsync_tree`, then
the rename that commits it). A worker fsyncing as well doubles the journal commits, and
does its share of the disk work in the process whose core the next step needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sft_runtime.events.log import fsync_dir
from sft_runtime.runtime.checkpoint.direct_io import DirectFile, write_safetensors
from sft_runtime.runtime.checkpoint.weight_reader import WEIGHTS_FILE, WEIGHTS_INDEX, read_all
from sft_runtime.runtime.errors import UserInputError

MAX_SHARD_BYTES = 5 * 2**30  # as large as hub models' shards usually are
OPTIMIZER_FILE = "optimizer.pt"


def rng_file(rank: int) -> str:
    return f"rank_{rank}.pt"


def atomic_write(path: str, write: Callable[[DirectFile], object], *, fsync: bool = True) -> None:
    """Write via ``write(fh)`` to ``path.tmp`` (a `DirectFile`: past the page cache where
    the filesystem allows), fsync, rename over ``path``, fsync the dir (without ``fsync``:
    the caller makes the folder durable)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with DirectFile(tmp) as fh:
            write(fh)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if fsync:
        fsync_dir(directory)


def weight_shards(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[dict[str, torch.Tensor]]:
    """Tensors in their order, cut into groups of at most ``max_shard_bytes`` (a tensor
    larger than that is a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of ``count`` weight shards, as transformers names them."""
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def save_weights(
    directory: str,
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int = MAX_SHARD_BYTES,
    *,
    fsync: bool = True,
) -> list[str]:
    """Write the weights as Hugging Face lays them out: ``model.safetensors``, or past
    ``max_shard_bytes`` ``model-0000k-of-0000n.safetensors`` plus the index that maps every
    name to its file (`write_safetensors`: one tensor's bytes on the host at a time, so the
    tensors may be the live ones, on any device)."""
    shards = weight_shards(tensors, max_shard_bytes)
    names = [WEIGHTS_FILE] if len(shards) == 1 else shard_names(len(shards))
    written = []
    for name, shard in zip(names, shards, strict=True):
        path = os.path.join(directory, name)
        atomic_write(
            path,
            lambda fh, shard=shard: write_safetensors(fh, shard, {"format": "pt"}),
            fsync=fsync,
        )
        written.append(path)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {
                k: name for name, shard in zip(names, shards, strict=True) for k in shard
            },
        }
        path = os.path.join(directory, WEIGHTS_INDEX)
        data = json.dumps(index, indent=2, sort_keys=True).encode()
        atomic_write(path, lambda fh: fh.write(data), fsync=fsync)
        written.append(path)
    return written


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    """The weights `save_weights` wrote (one file, or the shards its index names), or those
    of a sharded (FSDP2) checkpoint, consolidated."""
    return read_all(directory)


def save_torch(path: str, obj: Any, *, fsync: bool = True) -> str:
    atomic_write(path, lambda fh: torch.save(obj, fh), fsync=fsync)
    return path


def load_torch(path: str, what: str) -> Any:
    if not os.path.exists(path):
        raise UserInputError(f"checkpoint {what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file is bad input
        raise UserInputError(f"{path}: unreadable {what} ({type(exc).__name__}: {exc})") from exc


def capture_rng(num_threads: int) -> dict[str, Any]:
    """This process's RNG states in a form `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "num_threads": int(num_threads),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A seed for ``rank``'s RNGs after step ``step`` of a run seeded ``seed``: what a resume
    on another number of workers starts them from (no saved state maps to a new rank)."""
    digest = hashlib.sha256(f"sft-rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def seed_rng(seed: int) -> None:
    """Seed python's, numpy's and torch's RNGs (every device's) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def restore_rng(
    state: dict[str, Any], num_threads: int, path: str, *, allow_change: bool = False
) -> None:
    """Restore RNG states; refuse a thread count other than the one that wrote them, unless
    the user allowed the change (`config_change.py`: it is recorded in run_started)."""
    saved = int(state["num_threads"])
    if saved != num_threads and not allow_change:
        raise UserInputError(
            f"checkpoint {path} was written with {saved} torch thread(s) per worker but "
            f"cluster.num_threads_per_worker={num_threads}; results would not be bitwise "
            f"reproducible - set cluster.num_threads_per_worker={saved}"
        )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

"""Reading torch.distributed.checkpoint folders without running code from them.

torch's `FileSystemReader.read_metadata` unpickles ``.metadata`` with plain `pickle.load`
(and, when that fails, a rank's ``__<rank>.metadata``), so a file dropped into a checkpoint
would run whatever it names; and the default load planner reads a checkpoint's non-tensor
entries (an optimizer's hyperparameters) with ``torch.load(weights_only=False)``. Every read
of a sharded checkpoint in this runtime goes through this module instead:

- the metadata unpickler resolves only the globals a real DCP metadata file of this runtime
  contains (found by recording every ``find_class`` while loading the weights' and the
  optimizer's metadata of sharded checkpoints of the built-in transformer, a Hugging Face
  model and a LoRA run) and torch's dtypes; anything else is refused naming file and global;
- the metadata may name only data files directly inside the checkpoint folder;
- non-tensor entries are loaded ``weights_only=True``, as torch loads the tensor entries.

Errors are `UserInputError` (exit 2) naming the folder or file, never torch's multi-line
`CheckpointException`.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from sft_runtime.runtime.errors import UserInputError

_DCP_META = "torch.distributed.checkpoint.metadata"

#: The globals a DCP metadata file of this runtime needs (module, name), torch's dtypes aside.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_META, "BytesStorageMetadata"),
        (_DCP_META, "ChunkStorageMetadata"),
        (_DCP_META, "Metadata"),
        (_DCP_META, "MetadataIndex"),
        (_DCP_META, "StorageMeta"),
        (_DCP_META, "TensorProperties"),
        (_DCP_META, "TensorStorageMetadata"),
        (_DCP_META, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the folder it was written to
    }
)


class UnsafeCheckpointError(UserInputError):
    """A checkpoint file names a global outside the allow-list, or points outside its folder."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refusing to unpickle global {module}.{name}: not one of the classes "
            "torch.distributed.checkpoint metadata contains (the file is damaged or was not "
            "written by this runtime)"
        )


def _load_metadata(path: Path) -> Metadata:
    try:
        with open(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh, path).load()
    except UserInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or foreign: bad input, one line
        raise UserInputError(f"{path}: unreadable checkpoint metadata ({_one_line(exc)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UserInputError(f"{path}: not torch.distributed.checkpoint metadata")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(info, _StorageInfo)
            or not isinstance(name, str)
            or name in ("", ".", "..")
            or os.path.basename(name) != name
            or (os.altsep is not None and os.altsep in name)
        ):
            raise UnsafeCheckpointError(
                f"{path}: names the data file {name!r}, which is not a file of its own folder"
            )
    return metadata


def read_metadata(directory: str | os.PathLike) -> Metadata:
    """The metadata of a DCP folder, read through the allow-list."""
    return _load_metadata(Path(directory) / ".metadata")


class SafeFileSystemReader(FileSystemReader):
    """torch's reader with the allow-list metadata unpickler and ``weights_only`` loads of
    non-tensor entries (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _WeightsOnlyBytes(planner, Path(self.path)))


class _WeightsOnlyBytes:
    """The load planner as `read_data` sees it, except that a non-tensor entry is unpickled
    ``weights_only`` first. The planner then gets the value saved again by us, so whatever
    it does with it (its own unrestricted ``torch.load``) sees only plain data."""

    def __init__(self, planner: Any, directory: Path) -> None:
        self._planner = planner
        self._directory = directory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - refused by the weights-only unpickler
            raise UnsafeCheckpointError(
                f"{self._directory}: refusing the entry {read_item.dest_index.fqn!r}: it is "
                f"not plain data ({_one_line(exc)})"
            ) from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


def load(state: dict[str, Any], directory: str | os.PathLike, *, no_dist: bool = False) -> None:
    """Fill ``state`` in place from the DCP folder ``directory`` (a collective unless
    ``no_dist``); the metadata is read through the allow-list before torch reads it again."""
    import torch.distributed.checkpoint as dcp

    read_metadata(directory)  # a refusal here is one clean line, before any collective
    try:
        with warnings.catch_warnings():
            if no_dist:  # "no process group: loading in one process", said on every read
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(directory), no_dist=no_dist)
    except CheckpointException as exc:
        failures = [pair[0] for pair in exc.failures.values()]
        for failure in failures:
            if isinstance(failure, UserInputError):
                raise failure from None
        first = failures[0] if failures else exc
        raise UserInputError(
            f"{directory}: unreadable sharded checkpoint ({_one_line(first)})"
        ) from None
    except UserInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - a missing or truncated shard is bad input
        raise UserInputError(
            f"{directory}: unreadable sharded checkpoint ({_one_line(exc)})"
        ) from None


def _one_line(exc: BaseException) -> str:
    """An error as one line: its type and the last line of its message (torch's messages
    put the reason last)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__

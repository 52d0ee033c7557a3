"""Sharded checkpoint files (``policy.parallel.fsdp``), written with torch.distributed.checkpoint.

With FSDP2 no rank holds the whole model, so every rank writes its own shards in parallel:
``policy/weights/`` and ``policy/optimizer/`` are DCP checkpoints (``__<rank>_0.distcp``
files and the ``.metadata`` the coordinator writes last), inside the same ``tmp_step_<N>``
-> fsync -> rename protocol as every checkpoint, so a kill during a sharded save leaves a
temporary folder the next start removes, never a checkpoint that looks complete. The
writer fsyncs each file. torch is imported on use: the driver checks a checkpoint's layout
before anything heavy is loaded. Weights are saved under the model's own parameter names, so
`consolidate` (no process group, any world size) turns them back into one state dict for
`sft-runtime export`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sft_runtime.runtime.errors import UserInputError

if TYPE_CHECKING:
    import torch

METADATA = ".metadata"
TRAINER_STATE = "trainer_state.pt"  # the schedule's step count, beside the optimizer shards


def is_sharded(directory: str | os.PathLike) -> bool:
    """A DCP checkpoint folder (its metadata file is written last, by the coordinator)."""
    return (Path(directory) / METADATA).is_file()


def save_shards(directory: str, state: dict[str, Any]) -> list[str]:
    """Every rank calls this with its shards (a collective); returns the files it wrote."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.makedirs(directory, exist_ok=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, sync_files=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    files = [str(p) for p in Path(directory).glob(f"__{rank}_*.distcp")]
    return files + ([os.path.join(directory, METADATA)] if rank == 0 else [])


def load_shards(directory: str, state: dict[str, Any]) -> None:
    """Fill ``state`` (this rank's shards, as `sharded_state` built them) in place."""
    import torch.distributed.checkpoint as dcp

    if not is_sharded(directory):
        raise UserInputError(
            f"{directory}: not a sharded checkpoint (no {METADATA}); it was written with "
            "policy.parallel.fsdp=false - resume with that setting"
        )
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except Exception as exc:  # noqa: BLE001 - missing or damaged shard files are bad input
        raise UserInputError(f"{directory}: unreadable sharded checkpoint ({exc})") from exc


def consolidate(directory: str | os.PathLike, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The whole tensors of a sharded weights folder, read in this one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged metadata file is bad input
        raise UserInputError(f"{directory}: unreadable sharded checkpoint ({exc})") from None
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and key.startswith(prefix)
    }
    try:
        with warnings.catch_warnings():  # "no process group: loading in one process" is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except Exception as exc:  # noqa: BLE001 - a missing or truncated shard
        raise UserInputError(f"{directory}: unreadable sharded checkpoint ({exc})") from exc
    return {key.removeprefix(prefix): tensor for key, tensor in state.items()}

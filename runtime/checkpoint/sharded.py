"""Sharded checkpoint files (``policy.dtensor_cfg.enabled``), written with
torch.distributed.checkpoint.

With FSDP2 no rank holds the whole model, so every rank writes its own shards in parallel:
``policy/weights/`` and ``policy/optimizer/`` are DCP checkpoints (``__<rank>_0.distcp``
files and the ``.metadata`` the coordinator writes last), inside the same ``tmp_step_<N>``
-> fsync -> rename protocol as every checkpoint, so a kill during a sharded save leaves a
temporary folder the next start removes, never a checkpoint that looks complete. The
writer fsyncs each file. torch is imported on use: the driver checks a checkpoint's layout
before anything heavy is loaded. Weights are saved under the model's own parameter names, so
`weight_reader` (no process group, any world size) reads them back, tensor by tensor, for
`sft-runtime export`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sft_runtime.runtime.errors import UserInputError

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
    """Fill ``state`` (this rank's shards, as `sharded_state` built them) in place, read
    through the allow-list (`safe_dcp`): a checkpoint's files never run code."""
    from sft_runtime.runtime.checkpoint import safe_dcp

    if not is_sharded(directory):
        raise UserInputError(
            f"{directory}: not a sharded checkpoint (no {METADATA}); it was written with "
            "policy.dtensor_cfg.enabled=false - resume with that setting"
        )
    safe_dcp.load(state, directory)

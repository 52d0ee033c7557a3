"""The TensorBoard backend (``logger.tensorboard_enabled``): event files under the run.

A resumed attempt opens its writer with a purge mark at its first step, so TensorBoard hides
what earlier attempts wrote from there on: the steps the resume rolled back, as the event
log's lineage does. torch's writer is imported only here, so a run without the extra never
loads tensorboard.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_INSTALL = "pip install 'sft-runtime[tensorboard]'"


class TensorboardConfig(BaseModel):
    """NeMo RL's ``logger.tensorboard`` block: where the event files go, under the run."""

    model_config = ConfigDict(extra="forbid")

    log_dir: str = TENSORBOARD_DIR  # relative to the metrics' folder (the run directory)


class TensorboardWriter:
    """Scalars at global steps; ``close`` flushes the event file (a reader sees every step)."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self, reason: str = "completed") -> None:
        """TensorBoard records no outcome: every ``reason`` closes the same way."""
        self._writer.close()


def open_tensorboard(directory: Path, first_step: int) -> TensorboardWriter | None:
    """The writer of one attempt, or None (with a warning) where tensorboard is missing:
    config validation refuses the key on the driver, but the process that logs may run on
    a node without the extra, and it still trains."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            f"logger.tensorboard_enabled is on but tensorboard is not installed here "
            f"({TENSORBOARD_INSTALL}); metrics go to metrics.jsonl only",
            stacklevel=3,
        )
        return None
    purge = first_step if first_step > 1 else None
    return TensorboardWriter(SummaryWriter(str(directory), purge_step=purge))

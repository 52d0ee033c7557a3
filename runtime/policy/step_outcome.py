"""What a replica's step answers: the finish's figures, or whether an abort undid anything.

Plain frozen records, no torch, so the controller reads them without loading torch, and the
workers pass them on across Ray as they are (`runtime.workers.results`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepFinished:
    """`finish_train_step`: the step's global loss and what this rank measured of it."""

    loss: float
    grad_norm: float
    lr: float
    valid_tokens: int  # supervised tokens of the global batch
    local_valid_tokens: int
    micro_batches: list[dict[str, Any]]  # the loss function's metrics, one dict each
    forward_backward_s: float
    allreduce_s: float
    optimizer_s: float
    step: int  # steps done, this one included


@dataclass(frozen=True)
class StepUndone:
    """`abort_train_step`: whether a step was open, and the steps done (unchanged)."""

    aborted: bool
    step: int

"""What a policy worker answers across Ray: small frozen records with named fields.

A result read by position or by a string key breaks silently when one side renames a field;
a dataclass breaks where it is read, with the name in the error, and pickles as small as the
dict it replaces. Every field is plain data (floats, ints, strings, the loader's
`StepEnvelope`), so nothing here pulls torch into the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sft_runtime.runtime.data.batch import StepEnvelope
from sft_runtime.runtime.policy.step_outcome import StepFinished


@dataclass(frozen=True)
class StepStarted:
    """`start_sft_step`: the batch this rank loaded and trained on, up to its gradients."""

    envelope: StepEnvelope
    begin_s: float  # the supervised-token all-reduce
    forward_backward_s: float
    started_ns: int  # when the call began in the worker (a step sent ahead waits there)


@dataclass(frozen=True)
class StepTrained:
    """`train_sft_step`: a whole step on this rank, its start's and its finish's results."""

    started: StepStarted
    finished: StepFinished


@dataclass(frozen=True)
class CheckpointFiles:
    """`save_checkpoint` / `checkpoint_written`: the files this rank wrote (fsynced by
    `save_checkpoint`; by the caller with their folder after `checkpoint_written`)."""

    rank: int
    step: int
    files: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class CheckpointLoaded:
    """`load_checkpoint`: the step the replica now stands at, and whether RNG came with it."""

    rank: int
    step: int
    rng: bool


@dataclass(frozen=True)
class ValidationResult:
    """`validate`: this rank's part of a validation pass, summed so ranks weigh by tokens."""

    nll_sum: float
    tokens: int
    samples: int
    total: int  # samples in the whole pass
    source_ids: list[str]
    seconds: float

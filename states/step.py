"""One step's vocabulary: its phases, and what a step in flight has opened.

The same names serve the worker's errors (``exc.sft_phase``), the group's report of a
failed call (`PolicyWorkerError.phase`), the controller's bookkeeping, the ``phase`` of a
``step_aborted`` record and the step's fault points (``stepping:after_<phase>``), so a
failure reads the same wherever it is seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StepPhase(str, Enum):
    """The phases of one step, in the order they run."""

    loading = "loading"  # the owners' loaders deliver the batch (inside the worker's start)
    train = "train"  # begin, forward/backward, gradient all-reduce, optimizer (the workers)
    metrics = "metrics"  # the controller derives the step's metrics
    commit = "commit"  # the batch is marked committed (the commit rides on the next start)
    record = "record"  # step_committed is appended: the step counts

    @property
    def fault_point(self) -> str:
        """The fault point just after this phase (see runtime/process/faults.py)."""
        return f"stepping:after_{self.value}"


STEP_PHASES = tuple(StepPhase)


def earliest(phases: list[str | None]) -> StepPhase | None:
    """The first phase, in step order, among the ones workers reported (None if none)."""
    known = [StepPhase(p) for p in phases if p]
    return min(known, key=STEP_PHASES.index, default=None)


@dataclass
class StepInFlight:
    """How far a step got and what it holds open: exactly what an abort must undo."""

    phase: StepPhase = StepPhase.loading
    policy_open: bool = True  # gradients and RNG of the step are live in the workers
    batch_active: bool = True  # the loader batch is delivered and not committed

    def trained(self) -> None:
        """The optimizer step is taken: nothing in the policy is left to undo."""
        self.phase, self.policy_open = StepPhase.train, False

    def enter(self, phase: StepPhase) -> None:
        self.phase = phase

    def committed(self) -> None:
        self.batch_active = False

    def failed_phase(self, exc: BaseException) -> StepPhase:
        """The phase an error belongs to: the one a worker reported, else where we are."""
        reported = getattr(exc, "phase", None)
        return StepPhase(reported) if reported else self.phase

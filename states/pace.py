"""`StepPace`: how long this attempt's steps take, so a deadline save starts in time.

A scheduler's walltime kills the job at the deadline whatever it is doing, so waiting until
the deadline has passed to save loses the save. The pace predicts instead: the mean wall time
of the steps measured so far (each from the end of the previous one, so the saves in between
count), which says whether the next step would still end before the deadline.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepPace:
    """Step ends on one clock since the loaders became ready (pure: the caller gives ``now``)."""

    started: float | None = None
    last: float | None = None
    steps: int = 0

    def start(self, now: float) -> None:
        self.started, self.last, self.steps = now, None, 0

    def step_ended(self, now: float) -> None:
        if self.started is None:
            self.started = now
        self.last = now
        self.steps += 1

    @property
    def mean_step_s(self) -> float:
        """Mean seconds per step, saves included; 0 before the first step ends."""
        if self.steps == 0 or self.started is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.started) / self.steps

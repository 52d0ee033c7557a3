"""The guards of the machine as pure functions of the save state, the config and the clock.

One place decides when to save and when to stop, so the loop, the tests and a reader of
the log all agree on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from states.save_state import SFTV2SaveState


@dataclass(frozen=True)
class StepRules:
    """Budget, save period and deadline of a run (deadline in unix seconds, inf = none)."""

    max_steps: int
    save_period: int = 0
    checkpointing: bool = True
    deadline: float = math.inf

    def budget_reached(self, state: SFTV2SaveState) -> bool:
        return state.total_steps >= self.max_steps

    def timed_out(self, now: float) -> bool:
        return now >= self.deadline

    def save_due(self, state: SFTV2SaveState, *, now: float, stopping: bool = False) -> bool:
        """Periodic saves, plus a final save when the run ends for any reason."""
        if not self.checkpointing or state.total_steps == 0:
            return False
        if stopping or self.budget_reached(state) or self.timed_out(now):
            return True
        return self.save_period > 0 and state.total_steps % self.save_period == 0

    def should_stop(self, state: SFTV2SaveState, *, now: float, stopping: bool = False) -> bool:
        return stopping or self.budget_reached(state) or self.timed_out(now)

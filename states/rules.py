"""The guards of the machine as pure functions of the save state, the config and the clock.

One place decides when to save and when to stop, so the loop, the tests and a reader of
the log all agree on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sft_runtime.states.save_state import SFTV2SaveState


@dataclass(frozen=True)
class StepRules:
    """Budget, save periods and deadline of a run (deadline in unix seconds, inf = none).

    ``save_period`` saves are kept by metric (keep_top_k); ``ft_save_period`` saves exist
    for fault tolerance and are kept by recency. A run that ends for any reason (budget,
    deadline, stop request) saves once more, so a resume loses no step.
    """

    max_steps: int
    save_period: int = 0
    ft_save_period: int = 0
    checkpointing: bool = True
    deadline: float = math.inf

    def budget_reached(self, state: SFTV2SaveState) -> bool:
        return state.total_steps >= self.max_steps

    def timed_out(self, now: float) -> bool:
        return now >= self.deadline

    def save_kinds(
        self, state: SFTV2SaveState, *, now: float, stopping: bool = False
    ) -> tuple[str, ...]:
        """Why a checkpoint is due after this state ("periodic", "ft", "final"); () if not."""
        step = state.total_steps
        if not self.checkpointing or step == 0:
            return ()
        kinds = []
        if self.save_period > 0 and step % self.save_period == 0:
            kinds.append("periodic")
        if self.ft_save_period > 0 and step % self.ft_save_period == 0:
            kinds.append("ft")
        if self.should_stop(state, now=now, stopping=stopping):
            kinds.append("final")
        return tuple(kinds)

    def save_due(self, state: SFTV2SaveState, *, now: float, stopping: bool = False) -> bool:
        return bool(self.save_kinds(state, now=now, stopping=stopping))

    def should_stop(self, state: SFTV2SaveState, *, now: float, stopping: bool = False) -> bool:
        return stopping or self.budget_reached(state) or self.timed_out(now)

    def continues_after(self, state: SFTV2SaveState, now: float, *, stopping: bool) -> bool:
        """Another step follows ``state`` directly: no checkpoint due, no reason to stop (as of
        ``now``; a deadline or stop request may still come before that step begins)."""
        if self.should_stop(state, now=now, stopping=stopping):
            return False
        return not self.save_due(state, now=now, stopping=stopping)

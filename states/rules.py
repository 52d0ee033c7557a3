"""The guards of the machine as pure functions of the save state, the config and the deadline.

One place decides when to save and when to stop, so the loop, the tests and a reader of
the log all agree on it. Whether the deadline has come is the one input that needs a clock:
`StepRules.timed_out` judges it from ``now`` and the mean step time (see `states.pace`), and
the machine hands its latched verdict to the other rules as ``timed_out``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sft_runtime.states.save_state import SFTV2SaveState


@dataclass(frozen=True)
class StepRules:
    """Budget, save periods and deadline of a run (deadline in unix seconds, inf = none).

    ``save_period`` and ``ft_save_period`` say when to save (what is kept afterwards is
    `runtime.checkpoint.store.retained_steps`). A run that ends for any reason (budget,
    deadline, stop request) saves once more, so a resume loses no step.
    """

    max_steps: int
    save_period: int = 0
    ft_save_period: int = 0
    checkpointing: bool = True
    deadline: float = math.inf

    def budget_reached(self, state: SFTV2SaveState) -> bool:
        return state.total_steps >= self.max_steps

    def timed_out(self, now: float, mean_step_s: float = 0.0) -> bool:
        """Another step of the mean length would end past the deadline: save and stop now.

        Without measured steps (``mean_step_s`` 0) this is simply ``now >= deadline``.
        """
        return now + mean_step_s >= self.deadline

    def save_kinds(
        self, state: SFTV2SaveState, *, stopping: bool = False, timed_out: bool = False
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
        if self.should_stop(state, stopping=stopping, timed_out=timed_out):
            kinds.append("final")
        return tuple(kinds)

    def save_due(
        self, state: SFTV2SaveState, *, stopping: bool = False, timed_out: bool = False
    ) -> bool:
        return bool(self.save_kinds(state, stopping=stopping, timed_out=timed_out))

    def should_stop(
        self, state: SFTV2SaveState, *, stopping: bool = False, timed_out: bool = False
    ) -> bool:
        return stopping or timed_out or self.budget_reached(state)

    def continues_after(
        self, state: SFTV2SaveState, *, stopping: bool = False, timed_out: bool = False
    ) -> bool:
        """Another step follows ``state`` directly: no checkpoint due, no reason to stop (as
        far as known now; a deadline or stop request may still come before that step)."""
        if self.should_stop(state, stopping=stopping, timed_out=timed_out):
            return False
        return not self.save_due(state, stopping=stopping, timed_out=timed_out)

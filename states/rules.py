"""What comes after a step, as one pure function of the save state, the config and the deadline.

`StepRules.after` is the one place that decides whether a validation pass, a checkpoint or the
end of the run follows a step. The machine's guards read it for the state a trigger would
make; the loop reads it for the step just sent, to know whether the next step (or that step's
checkpoint) can be sent along; a test or a reader of the log can ask it of any state. Whether
the deadline has come is the one input that needs a clock: `StepRules.timed_out` judges it
from ``now`` and the mean step time (`StepPace`, below), and the caller passes its verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sft_runtime.states.save_state import SFTV2SaveState


@dataclass(frozen=True)
class ValidationSchedule:
    """When a validation pass follows a step (``sft.val_period``, ``val_at_start``: step 0,
    ``val_at_end``: the last step of the budget); the default never validates, as a run
    without validation data does."""

    period: int = 0
    at_start: bool = False
    at_end: bool = False

    def due(self, step: int, *, final: bool) -> bool:
        if step == 0:
            return self.at_start
        return bool(self.period and step % self.period == 0) or (final and self.at_end)


@dataclass(frozen=True)
class StepRules:
    """Budget, save periods, validation schedule and deadline of a run (deadline in unix
    seconds, inf = none).

    ``save_period`` and ``ft_save_period`` say when to save (what is kept afterwards is
    `runtime.checkpoint.store.retained_steps`). A run that ends for any reason (budget,
    deadline, stop request) saves once more, so a resume loses no step.
    """

    max_steps: int
    save_period: int = 0
    ft_save_period: int = 0
    checkpointing: bool = True
    deadline: float = math.inf
    validation: ValidationSchedule = field(default_factory=ValidationSchedule)

    def budget_reached(self, state: SFTV2SaveState) -> bool:
        return state.total_steps >= self.max_steps

    def timed_out(self, now: float, mean_step_s: float = 0.0) -> bool:
        """Another step of the mean length would end past the deadline: save and stop now.

        Without measured steps (``mean_step_s`` 0) this is simply ``now >= deadline``.
        """
        return now + mean_step_s >= self.deadline

    def after(
        self,
        state: SFTV2SaveState,
        *,
        stopping: bool = False,
        timed_out: bool = False,
        validated: bool = False,
    ) -> After:
        """What follows ``state``'s step: a validation pass (unless ``validated``: the log
        holds one for that step), a checkpoint and of which kinds, and whether the run stops.
        ``stopping``: a stop was requested; ``timed_out``: the deadline's verdict."""
        step = state.total_steps
        final = self.budget_reached(state)
        stop = stopping or timed_out or final
        kinds: list[str] = []
        if self.checkpointing and step > 0:
            if self.save_period > 0 and step % self.save_period == 0:
                kinds.append("periodic")
            if self.ft_save_period > 0 and step % self.ft_save_period == 0:
                kinds.append("ft")
            if stop:
                kinds.append("final")
        validate = not validated and self.validation.due(step, final=final)
        return After(validate=validate, save_kinds=tuple(kinds), stop=stop)


@dataclass(frozen=True)
class After:
    """What comes after a step, in the order it happens: validate, save, then stop or go on."""

    validate: bool
    save_kinds: tuple[str, ...]  # ("periodic", "ft", "final"): why a checkpoint is due
    stop: bool

    @property
    def saves(self) -> bool:
        return bool(self.save_kinds)

    @property
    def straight_on(self) -> bool:
        """The next step follows directly: nothing between the two, and no stop (as far as
        known now; a deadline or stop request may still come before that step)."""
        return not (self.validate or self.saves or self.stop)

    @property
    def name(self) -> str:
        """``continue``, ``save and continue``, ``save and stop`` or ``stop``, after
        ``validate, then`` when a pass comes first."""
        rest = ("save and " if self.saves else "") + ("stop" if self.stop else "continue")
        return f"validate, then {rest}" if self.validate else rest


# ---------------------------------------------------------------------- the step pace
# `StepPace`: how long this attempt's steps take, so a deadline save starts in time.
#
# A scheduler's walltime kills the job at the deadline whatever it is doing, so waiting until
# the deadline has passed to save loses the save. The pace predicts instead: the mean wall time
# of the steps measured so far (each from the end of the previous one, so the saves in between
# count), which says whether the next step would still end before the deadline.


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

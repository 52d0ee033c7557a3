"""The controller as one table of states and transitions (a `transitions` machine).

The loop in the controller only fires triggers; the table says which moves exist, the
guards (from `StepRules`) pick the branch, and the callbacks named in the table append the
events and fold them into the save state. There are no side doors: auto transitions are
off and a trigger that is not in the table for the current state raises `MachineError`.

Guards look at ``next_state``: the save state a trigger *would* produce. transitions
evaluates conditions before the callback that records the step, so the machine's
``prepare_event`` computes it once per trigger, with the same handler the fold uses. The same
callback reads the clock for the step pace, so a deadline is judged as of the step's end.

A step's own phases (`StepPhase`, `StepInFlight`, at the end) are named here as well: the
workers' errors, the aborts the machine records and the fault points all use those names.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from transitions import EventData, Machine

from sft_runtime.events.log import EventLog
from sft_runtime.events.schemas import EventPayload, LogRepaired
from sft_runtime.states.fold import (
    HANDLERS,
    apply,
    run_stopped_event,
    step_aborted_event,
)
from sft_runtime.states.rules import After, StepPace, StepRules
from sft_runtime.states.save_state import SFTV2SaveState, initial_save_state


class ControllerState(Enum):
    """Member names are the names the table uses (transitions keys states by name)."""

    setup = "setup"  # the attempt opens its log, the owners build their loaders
    ready = "ready"  # between steps: the next may start (it may run in the workers already)
    training = "training"  # the step is sent: the workers load, train and step the optimizer
    saving = "saving"
    closing = "closing"
    closed = "closed"


STATES = list(ControllerState)

TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "start", "source": "setup", "dest": None, "before": "record"},
    # a resume on another number of workers: recorded after run_started, the state unchanged
    {"trigger": "placement_changed", "source": "setup", "dest": None, "before": "record"},
    {"trigger": "loaders_ready", "source": "setup", "dest": "ready", "before": "record"},
    {
        "trigger": "halt",
        "source": "ready",
        "dest": "saving",
        "conditions": ["should_stop", "unsaved_steps"],
    },
    {"trigger": "halt", "source": "ready", "dest": "closing", "conditions": "should_stop"},
    # the step's call is on its way to the workers (or was sent ahead with the step before):
    # from here to its commit the workers load its batch, train and step the optimizer, and
    # the controller waits, then derives the step's metrics
    {"trigger": "step_sent", "source": "ready", "dest": "training"},
    {
        "trigger": "commit",
        "source": "training",
        "dest": "saving",
        "conditions": "save_due",
        "before": "record_step",
    },
    {
        "trigger": "commit",
        "source": "training",
        "dest": "closing",
        "conditions": "should_stop",
        "before": "record_step",
    },
    {"trigger": "commit", "source": "training", "dest": "ready", "before": "record_step"},
    {
        "trigger": "fail",
        "source": ["ready", "training"],
        "dest": "closing",
        "before": "record_abort",
    },
    {"trigger": "fail", "source": ["setup", "saving"], "dest": "closing"},
    {
        "trigger": "saved",
        "source": "saving",
        "dest": "closing",
        "conditions": "should_stop",
        "before": "record",
    },
    {"trigger": "saved", "source": "saving", "dest": "ready", "before": "record"},
    # a validation pass between steps (or at the start, or before the last save): recorded,
    # the state unchanged
    {
        "trigger": "validated",
        "source": ["ready", "saving", "closing"],
        "dest": None,
        "before": "record",
    },
    {"trigger": "close", "source": ["setup", "ready"], "dest": "closing"},
    {"trigger": "finish", "source": "closing", "dest": "closed", "after": "record_stop"},
]


class ControllerModel:
    """The model the machine drives: save state, rules, the log, and the recording callbacks.

    ``log`` may be None (nothing recorded, e.g. a dry run); ``clock`` and ``step_ahead``
    (whether the workers were sent the next step already) are injected, so guards stay pure
    in tests.
    """

    if TYPE_CHECKING:  # trigger methods that `Machine` binds at runtime

        def start(self, *, event: EventPayload) -> bool: ...
        def placement_changed(self, *, event: EventPayload) -> bool: ...
        def loaders_ready(self, *, event: EventPayload) -> bool: ...
        def halt(self) -> bool: ...
        def step_sent(self) -> bool: ...
        def commit(self, *, event: EventPayload) -> bool: ...
        def fail(self, *, error: BaseException, phase: str = "", **ids: Any) -> bool: ...
        def saved(self, *, event: EventPayload) -> bool: ...
        def validated(self, *, event: EventPayload) -> bool: ...
        def close(self) -> bool: ...
        def finish(self, *, reason: str, error: str | None = None) -> bool: ...

        state: ControllerState

    def __init__(
        self,
        rules: StepRules,
        *,
        log: EventLog | None = None,
        save_state: SFTV2SaveState | None = None,
        clock: Callable[[], float] = time.time,
        step_ahead: Callable[[], bool] = lambda: False,
    ) -> None:
        self.rules = rules
        self.log = log
        self.save_state = save_state or initial_save_state()
        self.clock = clock
        self.stop_requested = False
        self._step_ahead = step_ahead
        self.last_saved_step = self.save_state.total_steps  # a resume starts from a checkpoint
        self.next_state = self.save_state  # what the trigger being fired would make of it
        self.pace = StepPace()
        self._timed_out = False
        self.machine = build_machine(self)

    @property
    def step_ahead(self) -> bool:
        """The workers already run the next step (sent whole, it cannot be taken back): a stop
        request or the deadline takes effect after it, never before. Asked of the pipeline
        that sends steps (the ``step_ahead`` it was given), so it is never out of date."""
        return self._step_ahead()

    # -- the deadline -----------------------------------------------------------------------
    def save_by_timeout(self) -> bool:
        """The deadline's verdict, latched: once another step of the mean length would end
        past it, the run saves now and stops (it never un-fires)."""
        if not self._timed_out:
            self._timed_out = self.rules.timed_out(self.clock(), self.pace.mean_step_s)
        return self._timed_out

    def deadline_verdict(self) -> bool:
        """`save_by_timeout`, unless a step is ahead: that one is recorded first."""
        return False if self.step_ahead else self.save_by_timeout()

    def stop_verdicts(self) -> tuple[bool, bool]:
        """(stopping, timed out) as the save rules read them now: neither while a step is
        ahead (`step_ahead`)."""
        if self.step_ahead:
            return False, False
        return self.stop_requested, self.save_by_timeout()

    def deadline_within(self, steps: int) -> bool:
        """The deadline would fire within ``steps`` more steps of the mean length (a forecast
        for work sent ahead; it latches nothing)."""
        mean = self.pace.mean_step_s
        return self.save_by_timeout() or self.rules.timed_out(self.clock() + steps * mean, mean)

    # -- guards ---------------------------------------------------------------------------
    def prepare_next_state(self, event: EventData) -> None:
        """Before any guard of a trigger: the save state its event would fold to, and the
        step's end on the pace clock."""
        trigger = event.event.name
        if trigger == "loaders_ready":
            self.pace.start(self.clock())
        elif trigger == "commit":
            self.pace.step_ended(self.clock())
        payload = event.kwargs.get("event")
        handler = None if payload is None else HANDLERS.get(payload.event_type)
        self.next_state = (
            self.save_state if handler is None else handler(self.save_state, payload.model_dump())
        )

    def unsaved_steps(self, event: EventData) -> bool:
        """Steps committed since the last checkpoint (a stop between steps saves them)."""
        return self.rules.checkpointing and self.save_state.total_steps > self.last_saved_step

    def save_due(self, event: EventData) -> bool:
        return self._after().saves

    def should_stop(self, event: EventData) -> bool:
        return self._after().stop

    def _after(self) -> After:
        """`StepRules.after` for the state the trigger would make, with the stop verdicts in
        force now (a validation it may schedule is the loop's to run)."""
        stopping, timed_out = self.stop_verdicts()
        return self.rules.after(self.next_state, stopping=stopping, timed_out=timed_out)

    # -- callbacks: the only places events are appended -----------------------------------
    def _append(self, payload: EventPayload) -> None:
        if self.log is not None:
            record = self.log.append(payload)
            self.save_state = apply(self.save_state, record)
        else:  # nothing recorded: the same fold, from the payload itself
            self.save_state = self.next_state

    def record(self, event: EventData) -> None:
        payload = event.kwargs["event"]
        self._append(payload)
        if payload.event_type == "checkpoint_saved":
            self.last_saved_step = payload.step

    def record_step(self, event: EventData) -> None:
        self._append(event.kwargs["event"])

    def record_abort(self, event: EventData) -> None:
        error: BaseException = event.kwargs["error"]
        self._append(
            step_aborted_event(
                self.save_state.total_steps + 1,
                event.kwargs.get("phase") or self.state.value,
                error,
                trace_id=event.kwargs.get("trace_id"),
                span_id=event.kwargs.get("span_id"),
            )
        )

    def record_stop(self, event: EventData) -> None:
        self._append(
            run_stopped_event(
                event.kwargs["reason"], self.save_state.total_steps, event.kwargs.get("error")
            )
        )

    @property
    def repaired(self) -> LogRepaired | None:
        return None if self.log is None else self.log.repaired


def build_machine(model: ControllerModel) -> Machine:
    """Attach the one table to a model."""
    return Machine(
        model=model,
        states=ControllerState,
        transitions=TRANSITIONS,
        initial=ControllerState.setup,
        auto_transitions=False,
        prepare_event="prepare_next_state",
        send_event=True,
        queued=False,
    )


def mermaid() -> str:
    """The table as a Mermaid state diagram, for the README."""
    lines = ["stateDiagram-v2", "    [*] --> setup"]
    for row in TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        label = row["trigger"]
        if "conditions" in row:
            conditions = row["conditions"]
            label += (
                f" [{' and '.join(conditions) if isinstance(conditions, list) else conditions}]"
            )
        for source in sources:
            lines.append(f"    {source} --> {row['dest'] or source}: {label}")
    lines.append("    closed --> [*]")
    return "\n".join(lines)


# ---------------------------------------------------------------------- one step's phases
# One step's vocabulary: its phases, and what a step in flight has opened.
#
# The same names serve the worker's errors (``exc.sft_phase``), the group's report of a
# failed call (`PolicyWorkerError.phase`), the controller's bookkeeping, the ``phase`` of a
# ``step_aborted`` record and the step's fault points (``stepping:after_<phase>``), so a
# failure reads the same wherever it is seen.


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

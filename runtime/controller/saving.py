"""`SavePhase`: the controller's ``saving`` state, whether a checkpoint is due and writing it.

Part of `SFTController` (its base class), so the seed API's private steps (`_should_save`,
`_loader_state_dicts`, `_checkpoint_metric`, `_save_checkpoint`) stay methods of the
controller that an embedding user can read or override. The loader states come first, then
the writes, then the next step, all sent before anything is waited for: either with
the step before the save (`SaveAhead`, a periodic save the run goes on after) or when the
save begins.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from sft_runtime.runtime.controller.save_ahead import SaveAhead
from sft_runtime.runtime.errors import quietly
from sft_runtime.runtime.policy.calls import Pending
from sft_runtime.runtime.process.faults import fault_point
from sft_runtime.states import ControllerState
from sft_runtime.traces.context import inject_carrier
from sft_runtime.traces.spans import SAVE_SPAN, traced


class SavePhase:
    """The checkpoint half of `SFTController` (which sets every attribute, and defines every
    method, read here but not defined here)."""

    model: Any
    calls: Any
    group: Any
    checkpointer: Any
    validator: Any
    _save_ahead: SaveAhead | None
    _stop: threading.Event  # set by `request_stop`
    _job: Any  # the job span each step links to
    _attempt: int | None  # the log's attempt number (a property of the controller)
    _owner_call: Callable[[Any], Any]  # a loader-owner call of the group, traced
    _policy_metrics: Callable[[], dict[str, Any]]  # the last committed step's metrics

    def _send_save_ahead(self, state: Any) -> None:
        """The checkpoint after ``state``'s step, sent behind the step's finish, and the next
        step's start behind the checkpoint's writes (`SaveAhead`)."""
        self._save_ahead = SaveAhead.send(
            state,
            group=self.group,
            checkpointer=self.checkpointer,
            attempt=self._attempt,
            job=self._job,
        )
        self.calls.send_ahead(
            state.total_steps + 1, commit=False, attempt=self._attempt, job=self._job
        )

    def _take_save_ahead(self, state: Any, *, final: bool) -> SaveAhead | None:
        """The save sent ahead for ``state``'s step, unless it turned out to be the last one
        (or there is none); one not taken is discarded."""
        ahead, self._save_ahead = self._save_ahead, None
        if ahead is not None and (final or ahead.step != state.total_steps):
            quietly("discard the checkpoint sent ahead", ahead.discard)
            return None
        return ahead

    def _send_ahead_past_save(self, state: Any) -> None:
        """Workers start the next step once their checkpoint files are written, while the
        controller finishes the checkpoint (unless the run stops, or the deadline is near)."""
        timed_out = self.model.deadline_within(2)
        if not self.model.rules.after(
            state, stopping=self._stop.is_set(), timed_out=timed_out
        ).stop:
            step, attempt = state.total_steps + 1, self._attempt  # the save committed
            self.calls.send_ahead(step, commit=False, attempt=attempt, job=self._job)

    def _loader_state_dicts(self, sent: Pending | None = None) -> list[bytes]:
        """Each owner's loader state at the last committed step, pickled in the worker (see
        `dump_loader_state`): the calls a save `sent` ahead of its writes, or sent now."""
        return self.group.wait(sent if sent is not None else self._send_loader_states())

    def _send_loader_states(self) -> Pending:
        """The loader-state calls at the last committed step, whose batch the same call
        commits when no step did it. Never with a step sent ahead: the machine saves only
        after that one (`step_ahead`), or with the save sent along with it."""
        if self.calls.has_ahead:
            raise RuntimeError("a checkpoint of the last recorded step after the next was sent")
        commit = self.calls.take_commit()
        return self._owner_call(partial(self.group.send_loader_state_bytes, commit))

    def _should_save(self, *, save_by_timeout: bool) -> bool:
        """Whether a checkpoint is written now: the machine's save rules moved it to
        ``saving`` (a save period, the end of the budget, a stop request, or the deadline,
        whose verdict ``save_by_timeout`` is: the guards read the same latched one)."""
        saving = self.model.state is ControllerState.saving
        if save_by_timeout and self.model.rules.checkpointing and not saving:
            unsaved = self.model.save_state.total_steps > self.model.last_saved_step
            if unsaved:
                raise RuntimeError(
                    "the deadline passed with unsaved steps but the machine is not saving"
                )
        return saving

    def _checkpoint_metric(self, metrics: dict[str, Any]) -> dict[str, float]:
        """``{"train:<name>": value}`` for ``checkpointing.metric_name`` (``{}`` without
        one; ``val:<name>`` from the latest validation); the config refuses an unknown name
        before Ray starts."""
        return self.checkpointer.metric(metrics, self.validator.latest)

    def _save_checkpoint(self) -> None:
        """Write the checkpoint of the save state; the workers go on to the next step (sent
        behind their files) while the controller completes the directory."""
        state, rules, attempt = self.model.save_state, self.model.rules, self._attempt
        stopping, timed_out = self.model.stop_verdicts()
        kinds = rules.after(state, stopping=stopping, timed_out=timed_out).save_kinds
        metrics = self._policy_metrics()
        metric = self._checkpoint_metric(metrics) if metrics else {}
        ahead = self._take_save_ahead(state, final="final" in kinds)
        if ahead is not None:
            with ahead.current():
                ahead.write.describe(state, kinds=kinds, metric=metric)
                self._complete_save(ahead.states, ahead.write)
        else:
            with traced(SAVE_SPAN, attributes={"step": state.total_steps, "attempt": attempt}):
                states = self._send_loader_states()  # run by the workers before their writes
                write = self.checkpointer.begin(
                    state,
                    kinds=kinds,
                    metric=metric,
                    attempt=attempt,
                    final=rules.budget_reached(state),
                    carrier=inject_carrier(),
                )
                self._complete_save(states, write, past=state)
        fault_point("saving:after_record", step=state.total_steps, attempt=attempt)
        quietly("prune old checkpoints", self.checkpointer.prune)

    def _complete_save(self, states: Pending, write: Any, *, past: Any = None) -> None:
        """Wait for the loader states (first sending the next step's start behind the writes,
        for a save sent now: ``past`` is its state), complete the directory, record it; the
        writes are discarded if anything before the completion fails."""
        try:
            if past is not None:
                self._send_ahead_past_save(past)
            loader_states = self._loader_state_dicts(states)
        except BaseException:
            quietly("discard the checkpoint", write.discard)
            raise
        self.model.saved(event=write.complete(loader_states))

    def _discard_save_ahead(self) -> None:
        ahead, self._save_ahead = self._save_ahead, None
        if ahead is not None:
            quietly("discard the checkpoint sent ahead", ahead.discard)

"""`ControllerTeardown`: how a controller undoes a failed step and ends an attempt.

A failed step (`_abort_step`) is undone in the workers, the start sent ahead with it too, and
recorded as ``step_aborted``, so the run can go on or resume as if it never began.

Mixed into `runtime.controller.loop.SFTController` (whose run loop calls `_close` from its
``finally``): the loaders closed after their last commit, the workers' and this process's
spans flushed against one shutdown deadline, the machine closed and ``run_stopped``
recorded, then the summary `run` returns. Every cleanup step only warns when it fails
(`quietly`), so the error that ended the run is the one reported.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace

from sft_runtime.runtime.errors import quietly
from sft_runtime.runtime.metrics.step_metrics import run_summary
from sft_runtime.runtime.process.faults import fault_point
from sft_runtime.states import ControllerState, StepInFlight
from sft_runtime.traces.context import inject_carrier, span_ids


class ControllerTeardown:
    """The end of an attempt (see the module docstring); uses the controller's state."""

    config: Any
    group: Any
    calls: Any
    model: Any
    log: Any
    metrics: Any
    ckpt: Any
    run_dir: Any
    max_steps: int
    _stop: Any
    _losses: list[float]
    _sample_counts: dict[str, int]
    _flush_by: float | None
    _attempt: int | None
    _owner_call: Any  # the controller's method: a group call joined to the current trace

    def _abort_step(self, exc: BaseException, in_flight: StepInFlight) -> None:
        """Undo what the step opened, record `step_aborted`; cleanup failures only warn."""
        phase = in_flight.failed_phase(exc)
        quietly("wait for the step's calls", self.calls.settle)
        policy_open, batch_active = in_flight.policy_open, in_flight.batch_active
        if self.calls.has_ahead:  # a start sent ahead is undone with this step
            policy_open = batch_active = True
            quietly("discard the step started ahead", self.calls.drop_ahead)
        if policy_open:
            abort = self.group.abort_train_step
            quietly("abort the policy step", lambda: abort(carrier=inject_carrier()))
        if batch_active:
            quietly("abort the loader batches", lambda: self._owner_call(self.group.abort_batches))
        span = span_ids(trace.get_current_span())
        quietly(
            "record step_aborted",
            lambda: self.model.fail(
                error=exc, phase=phase.value, trace_id=span[0], span_id=span[1]
            ),
        )

    def _close_loaders(self) -> None:
        try:
            self.calls.drop_ahead()
            self.calls.flush_commit()
        finally:
            self._owner_call(self.group.close_loaders)

    def _close(self, reason: str, error: BaseException | None) -> None:
        """Teardown in order: loaders, logger, checkpoints, telemetry; then run_stopped."""
        quietly("close the loaders", self._close_loaders)
        # one shutdown deadline for the workers, this process and the driver (the summary
        # carries it): a dead collector costs the run shutdown_timeout_s once
        self._flush_by = time.time() + self._flush_bound()
        flush = self.group.flush_telemetry
        quietly(
            "export the workers' spans",
            lambda: flush(deadline=self._flush_by, carrier=inject_carrier()),
        )
        if self.metrics is not None:
            quietly("close the metrics logger", self.metrics.close)
        if self.model is not None and self.log is not None:
            if self.model.state in (ControllerState.setup, ControllerState.loading):
                quietly("close the machine", self.model.close)
            elif self.model.state is ControllerState.saving:
                quietly("close the machine", lambda: self.model.fail(error=error))
            if self.model.state is ControllerState.closing:
                step = self.model.save_state.total_steps
                fault_point("closing:before_stop", step=step, attempt=self._attempt)
                msg = None if error is None else f"{type(error).__name__}: {error}"[:2000]
                quietly("record run_stopped", lambda: self.model.finish(reason=reason, error=msg))
        if self.log is not None:
            self.log.close()

    def _flush_bound(self) -> float:
        telemetry = self.config.telemetry
        return telemetry.shutdown_timeout_s if telemetry is not None else 0.0

    def _end_reason(self) -> str:
        if self._stop.is_set():
            return "interrupted"
        if self.model.rules.budget_reached(self.model.save_state):
            return "completed"
        return "timeout" if self.model.save_by_timeout() else "completed"

    def _summary(self, start_step: int, reason: str) -> dict[str, Any]:
        return run_summary(
            self.model.save_state,
            reason=reason,
            attempt=self.log.attempt,
            start_step=start_step,
            max_steps=self.max_steps,
            losses=self._losses,
            checkpoints=self.ckpt.steps(),
            run_dir=self.run_dir,
            sample_counts=self._sample_counts,
        ) | {"telemetry_flush_by": self._flush_by}

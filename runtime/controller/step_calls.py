"""`StepCalls`: each step's worker calls, sent so that the workers never wait on the controller.

A step is two calls per worker: `start_sft_step` (commit the previous batch, load, begin,
forward/backward) and `finish_train_step` (gradient all-reduce, optimizer). Ray runs an
actor's calls in the order they were sent, so the controller sends step N's finish and, when
step N+1 is certain to follow, step N+1's start before it waits for anything: a worker goes
from finishing N straight into N+1 while the controller checks and records N. Measured on
a 2-core machine, the gap between steps fell from about 5 ms to the worker's own overhead.

Everything a start does can be undone (`abort_train_step` rewinds gradients and RNG,
`abort_sft_batch` the loader), so a start sent ahead that is then not wanted (a stop request,
a deadline, a failure while recording step N) is waited for and undone, and the run goes on
exactly as if it had never been sent.

Loader commits: a step's batch is committed by the next start (``commit_previous``), which a
worker refuses unless that step finished there. When no start follows, a checkpoint's
loader-state call commits first (`take_commit`), and at the end of the run `flush_commit`
sends the commit on its own.
"""

from __future__ import annotations

from typing import Any

from sft_runtime.runtime.policy.calls import Pending
from sft_runtime.traces.step_trace import StepTrace

SETTLE_TIMEOUT_S = 30.0


class StepCalls:
    """The start/finish calls of the current step and of a step started ahead."""

    def __init__(self, group: Any, loss_fn: Any) -> None:
        self.group = group
        self.loss_fn = loss_fn
        self.commit_pending = False  # the last recorded step's batch still needs a commit
        self._ahead: tuple[int, Pending, StepTrace] | None = None  # (step, its start, trace)
        self._sent: Pending | None = None  # the current step's calls, for `settle`

    @property
    def has_ahead(self) -> bool:
        return self._ahead is not None

    def ahead_trace(self, step: int) -> StepTrace | None:
        """The trace of ``step`` when its start was sent ahead (the step runs inside it)."""
        return self._ahead[2] if self._ahead is not None and self._ahead[0] == step else None

    def start(self, step: int, carrier: dict) -> Pending:
        """``step``'s start: the one sent ahead, or sent now."""
        if self._ahead is not None:
            ahead, pending, _ = self._ahead
            if ahead != step:
                raise RuntimeError(f"step {ahead} was started ahead, but step {step} is next")
            self._ahead = None
        else:
            pending = self.group.send_start(self.loss_fn, self.take_commit(), carrier=carrier)
        self._sent = pending
        return pending

    def finish(self, carrier: dict) -> Pending:
        pending = self.group.send_finish(carrier=carrier)
        self._sent = pending if self._sent is None else self._sent + pending
        return pending

    def send_ahead(self, step: int, *, commit: bool, attempt: int | None, job: Any) -> None:
        """Send ``step``'s start now, queued behind the calls sent so far (the current step's
        finish, or a checkpoint's), in a step trace of its own (linked to ``job``); with
        ``commit`` it commits the current step's batch in the worker if (and only if) that
        step finished there."""
        trace = StepTrace(step, attempt=attempt, job=job, sent_ahead=True)
        pending = self.group.send_start(
            self.loss_fn, commit, sent_ahead=True, carrier=trace.carrier()
        )
        self._ahead = (step, pending, trace)

    def recorded(self) -> None:
        """The current step is recorded: its batch is committed by the start sent ahead, or
        by the next start, a checkpoint or `flush_commit` when none was."""
        self.commit_pending = self._ahead is None
        self._sent = None

    def take_commit(self) -> bool:
        """Whether the last recorded step's batch still needs its commit; the caller sends it
        (a checkpoint's loader-state call does)."""
        pending, self.commit_pending = self.commit_pending, False
        return pending

    def flush_commit(self) -> None:
        """Commit the last recorded step's batch now (before the loaders close)."""
        if self.take_commit():
            self.group.commit_batches()

    def settle(self) -> None:
        """Wait (errors ignored) for every call of the current step and of one started ahead,
        so an abort sent next runs after them and no failed result goes unread."""
        pending = [p for p in (self._sent, self._ahead and self._ahead[1]) if p]
        self._sent = None
        if pending:
            self.group.settle(sum(pending[1:], pending[0]), SETTLE_TIMEOUT_S)

    def drop_ahead(self) -> bool:
        """Undo a start sent ahead (wait for it, then abort the step and the batch it opened;
        its span ends marked discarded); True when there was one. The loader keeps the
        commit the start made."""
        if self._ahead is None:
            return False
        self.settle()
        trace = self._ahead[2]
        self._ahead = None
        trace.end(attributes={"sft.discarded": True})
        self.commit_pending = False
        self.group.abort_train_step()
        self.group.abort_batches()
        return True

"""`StepCalls`: each step's worker calls, sent so that the workers never wait on the controller.

A step is one call per worker, `train_sft_step`: commit the previous batch, load, begin,
forward/backward, then the gradient all-reduce and the optimizer. Ray runs an actor's calls
in the order they were sent, so when step N+1 is certain to follow, the controller sends it
right behind step N before it waits for anything: a worker goes from N straight into N+1
while the controller checks and records N. One call a step, not two (a start, then a
finish), because each hand-over from Ray costs the controller and the worker CPU that the
next step waits for on a machine whose cores the workers fill.

A step sent ahead is sent whole, so it cannot be taken back once it ran: it is recorded
before the run stops or saves for a stop request or the deadline (the machine's
``step_ahead``: such a step moves the stop one step later). It is sent only when no
checkpoint, validation or budget end falls between the two steps, and when the deadline is
not forecast within two steps. When the attempt fails instead (a failure while recording
step N), the step sent ahead is waited for and whatever of it is still open is aborted
(`drop_ahead`); the workers may then hold a step that no event records, which nothing
saves: the attempt ends, and a resume loads the last checkpoint.

Loader commits: a step's batch is committed by the next step's call (``commit_previous``),
which a worker refuses unless that step finished there. When no step follows at once, a
checkpoint's loader-state call commits first (`take_commit`), and at the end of the run
`flush_commit` sends the commit on its own.
"""

from __future__ import annotations

from typing import Any

from sft_runtime.runtime.policy.calls import Pending
from sft_runtime.traces.step_trace import StepTrace

SETTLE_TIMEOUT_S = 30.0


class StepCalls:
    """The call of the current step and of a step sent ahead."""

    def __init__(self, group: Any, loss_fn: Any) -> None:
        self.group = group
        self.loss_fn = loss_fn
        self.commit_pending = False  # the last recorded step's batch still needs a commit
        self._ahead: tuple[int, Pending, StepTrace] | None = None  # (step, its call, trace)
        self._sent: Pending | None = None  # the current step's call, for `settle`

    @property
    def has_ahead(self) -> bool:
        return self._ahead is not None

    def ahead_trace(self, step: int) -> StepTrace | None:
        """The trace of ``step`` when it was sent ahead (the step runs inside it)."""
        return self._ahead[2] if self._ahead is not None and self._ahead[0] == step else None

    def send(self, step: int, trace: StepTrace) -> Pending:
        """``step``'s call: the one sent ahead, or sent now under ``trace``."""
        if self._ahead is not None:
            ahead, pending, _ = self._ahead
            if ahead != step:
                raise RuntimeError(f"step {ahead} was sent ahead, but step {step} is next")
            self._ahead = None
        else:
            pending = self._send(trace, self.take_commit(), sent_ahead=False)
        self._sent = pending
        return pending

    def send_ahead(self, step: int, *, commit: bool, attempt: int | None, job: Any) -> None:
        """Send ``step`` now, queued behind the calls sent so far (the current step, or a
        checkpoint's), in a step trace of its own (linked to ``job``); with ``commit`` it
        commits the current step's batch in the worker if (and only if) that step finished
        there."""
        trace = StepTrace(step, attempt=attempt, job=job, sent_ahead=True)
        self._ahead = (step, self._send(trace, commit, sent_ahead=True), trace)

    def _send(self, trace: StepTrace, commit: bool, *, sent_ahead: bool) -> Pending:
        return self.group.send_step(
            self.loss_fn,
            commit,
            sent_ahead=sent_ahead,
            carrier=trace.carrier(),
            finish_carrier=trace.training_carrier(),
        )

    def recorded(self) -> None:
        """The current step is recorded: its batch is committed by the step sent ahead, or
        by the next step, a checkpoint or `flush_commit` when none was."""
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
        """Wait (errors ignored) for the current step's call and one sent ahead, so an abort
        sent next runs after them and no failed result goes unread."""
        pending = [p for p in (self._sent, self._ahead and self._ahead[1]) if p]
        self._sent = None
        if pending:
            self.group.settle(sum(pending[1:], pending[0]), SETTLE_TIMEOUT_S)

    def drop_ahead(self) -> bool:
        """Give up a step sent ahead, when the attempt ends without recording it: wait for
        it, then abort what of it is still open (a step that failed midway, the batch it
        opened); its span ends marked discarded. True when there was one."""
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

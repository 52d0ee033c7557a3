"""`Pipeline`: everything the controller has sent the workers and not yet settled, in one place.

That is the current step's call, the next step sent ahead of it, a checkpoint sent ahead with
its step (`SaveAhead`), and the loader commit the last recorded step still owes: each a named
field here, each decided here, so a reader finds what is in flight without following the loop.
Whether a step or a save may be sent ahead is `StepRules.after`'s answer, which the loop asks.

Each step's worker calls are sent so that the workers never wait on the controller.

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

from dataclasses import dataclass
from typing import Any

from sft_runtime.runtime.checkpoint.save import Checkpointer
from sft_runtime.runtime.controller.save_ahead import SaveAhead
from sft_runtime.runtime.errors import quietly
from sft_runtime.runtime.workers.calls import Pending
from sft_runtime.states import SFTV2SaveState
from sft_runtime.traces.step_trace import StepTrace, TraceOrigin

SETTLE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class StepAhead:
    """A step sent before the one in flight was recorded: its number, call and trace."""

    step: int
    call: Pending
    trace: StepTrace


class Pipeline:
    """The calls in flight: the current step, a step and a checkpoint sent ahead, and the
    loader commit owed."""

    def __init__(self, group: Any, loss_fn: Any, checkpointer: Checkpointer) -> None:
        self.group = group
        self.loss_fn = loss_fn
        self.checkpointer = checkpointer
        self.current: Pending | None = None  # the current step's call, for `settle`
        self.ahead: StepAhead | None = None
        self.save_ahead: SaveAhead | None = None  # a periodic save sent with its step
        self.commit_pending = False  # the last recorded step's batch still needs a commit

    @property
    def has_ahead(self) -> bool:
        return self.ahead is not None

    def ahead_trace(self, step: int) -> StepTrace | None:
        """The trace of ``step`` when it was sent ahead (the step runs inside it)."""
        ahead = self.ahead
        return ahead.trace if ahead is not None and ahead.step == step else None

    def send(self, step: int, trace: StepTrace) -> Pending:
        """``step``'s call: the one sent ahead, or sent now under ``trace``."""
        if self.ahead is not None:
            if self.ahead.step != step:
                raise RuntimeError(
                    f"step {self.ahead.step} was sent ahead, but step {step} is next"
                )
            pending, self.ahead = self.ahead.call, None
        else:
            pending = self._send(trace, self.take_commit(), sent_ahead=False)
        self.current = pending
        return pending

    def send_ahead(self, step: int, *, commit: bool, origin: TraceOrigin) -> None:
        """Send ``step`` now, queued behind the calls sent so far (the current step, or a
        checkpoint's), in a step trace of its own (linked to the job span); with ``commit`` it
        commits the current step's batch in the worker if (and only if) that step finished
        there."""
        trace = StepTrace(step, origin, sent_ahead=True)
        self.ahead = StepAhead(step, self._send(trace, commit, sent_ahead=True), trace)

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
        self.commit_pending = self.ahead is None
        self.current = None

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
        pending = [p for p in (self.current, self.ahead and self.ahead.call) if p]
        self.current = None
        if pending:
            self.group.settle(sum(pending[1:], pending[0]), SETTLE_TIMEOUT_S)

    def drop_ahead(self) -> bool:
        """Give up a step sent ahead, when the attempt ends without recording it: wait for
        it, then abort what of it is still open (a step that failed midway, the batch it
        opened); its span ends marked discarded. True when there was one."""
        if self.ahead is None:
            return False
        self.settle()
        trace, self.ahead = self.ahead.trace, None
        trace.end(attributes={"sft.discarded": True})
        self.commit_pending = False
        self.group.abort_train_step()
        self.group.abort_batches()
        return True

    # -- a checkpoint sent ahead with its step ---------------------------------------------
    def send_save_ahead(self, state: SFTV2SaveState, *, origin: TraceOrigin) -> None:
        """The checkpoint after ``state``'s step, sent behind the step's finish, and the next
        step's start behind the checkpoint's writes (`SaveAhead`)."""
        self.save_ahead = SaveAhead.send(
            state,
            group=self.group,
            checkpointer=self.checkpointer,
            attempt=origin.attempt,
            job=origin.job,
        )
        self.send_ahead(state.total_steps + 1, commit=False, origin=origin)

    def take_save_ahead(self, step: int, *, final: bool) -> SaveAhead | None:
        """The save sent ahead for ``step``, unless it turned out to be the last one (or
        there is none); one not taken is discarded."""
        ahead, self.save_ahead = self.save_ahead, None
        if ahead is not None and (final or ahead.step != step):
            quietly("discard the checkpoint sent ahead", ahead.discard)
            return None
        return ahead

    def discard_save_ahead(self) -> None:
        ahead, self.save_ahead = self.save_ahead, None
        if ahead is not None:
            quietly("discard the checkpoint sent ahead", ahead.discard)

    def send_loader_states(self, *, carrier: dict | None) -> Pending:
        """The loader-state calls at the last committed step, whose batch the same call
        commits when no step did it. Never with a step sent ahead: the machine saves only
        after that one (`step_ahead`), or with the save sent along with it."""
        if self.has_ahead:
            raise RuntimeError("a checkpoint of the last recorded step after the next was sent")
        return self.group.send_loader_state_bytes(self.take_commit(), carrier=carrier)

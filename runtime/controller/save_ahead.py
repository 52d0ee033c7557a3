"""`SaveAhead`: a periodic checkpoint's worker calls, sent together with the step before it.

After a step at which a save is due and the run goes on (the save period: no stop request,
deadline or validation in sight), the controller queues right behind the step the
loader-state calls, the checkpoint writes and the next step, before it waits for
anything. Ray runs an actor's calls in the order they were sent, so a worker goes from the
step into its share of the checkpoint and on into the next step without waiting for the
controller to record the step first: that wait (a round trip and an fsynced event) is what a
save used to cost every worker.

Nothing is committed early. Each loader-state call commits the step's batch only if the step
finished on that worker (otherwise it fails), and the checkpoint directory is completed by
`CheckpointWrite.complete` only after the step's event is recorded, with the state and
metric that record holds (`CheckpointWrite.describe`). A stop request or the deadline that
comes meanwhile takes effect after the step sent with the save (`Pipeline`), so the save is
kept. When the step fails, the calls are given up (`discard`): their results are read, errors
and all, and their temporary directory is removed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from sft_runtime.runtime.checkpoint.save import DISCARD_WAIT_S, Checkpointer, CheckpointWrite
from sft_runtime.runtime.workers.calls import Pending
from sft_runtime.states import SFTV2SaveState
from sft_runtime.traces.context import TRACER, inject_carrier
from sft_runtime.traces.spans import SAVE_SPAN, record_error


class SaveAhead:
    """The loader-state calls and checkpoint writes of step ``step``, sent before it was
    recorded, under a save span of their own."""

    def __init__(
        self, step: int, states: Pending, write: CheckpointWrite, group: Any, span: Any
    ) -> None:
        self.step = step
        self.states = states  # the owners' `sft_dataloader_state_bytes`, commit first
        self.write = write
        self._group = group
        self._span = span

    @classmethod
    def send(
        cls,
        state: SFTV2SaveState,
        *,
        group: Any,
        checkpointer: Checkpointer,
        attempt: int | None,
        job: Any,
    ) -> SaveAhead:
        """Send the loader-state calls and the writes of the checkpoint of ``state`` (the
        state the step will have: only its step number is used until `describe`)."""
        context = trace.set_span_in_context(job) if job is not None else None
        attributes = {"step": state.total_steps, "sft.sent_ahead": True}
        if attempt is not None:
            attributes["attempt"] = attempt
        span = TRACER.start_span(SAVE_SPAN, context=context, attributes=attributes)
        carrier = inject_carrier(span)
        states = group.send_loader_state_bytes(True, carrier=carrier)
        try:
            write = checkpointer.begin(
                state, kinds=(), metric={}, attempt=attempt, final=False, carrier=carrier
            )
        except BaseException:
            try:
                group.settle(states, DISCARD_WAIT_S)
            finally:
                span.end()
            raise
        return cls(state.total_steps, states, write, group, span)

    @contextmanager
    def current(self) -> Iterator[None]:
        """The rest of the save (waiting for the states, completing the directory) inside the
        span the calls were sent under; it ends with it."""
        token = otel_context.attach(trace.set_span_in_context(self._span))
        try:
            yield
        except BaseException as exc:
            record_error(self._span, exc)
            raise
        finally:
            otel_context.detach(token)
            self._span.end()

    def discard(self) -> None:
        """Give the calls up: wait for them (errors read and dropped), remove the files."""
        try:
            self._group.settle(self.states, DISCARD_WAIT_S)
            self.write.discard()
        finally:
            self._span.set_attribute("sft.discarded", True)
            self._span.end()

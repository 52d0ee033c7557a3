"""Span helpers on the API only: names, error marking, remote parents, and the step trace.

Step traces: each ``rl.sft_v2.step`` is the root of its own trace, linked to the job span,
not a child of it. Why:

- Size. A child step would put every step of a run into the job's trace: 100k steps with
  ~10-50 spans each is millions of spans in one trace, which Jaeger UI cannot render (it
  loads a whole trace into the browser) and which no backend can show until the job ends.
  One trace per step stays a few dozen spans, opens instantly, and is complete (and
  searchable) as soon as the step ends.
- Lookup. ``step_committed`` stores the step's trace id, so a log line leads to exactly one
  small trace; search by tag ``step=N`` finds the same one. `sft-runtime trace --step N`
  prints it.
- Nothing is lost. The step span carries a ``FOLLOWS_FROM`` link to the job span (OTel link;
  a Jaeger reference) and the job's trace id as ``sft.job.trace_id``, so the job trace
  (driver, job, setup, saves, teardown) and each step trace point at each other. The job
  trace stays small: setup, one save span per checkpoint, teardown.

The cost is that Jaeger shows no single waterfall of the whole run; the metrics (and
``metrics.jsonl``) are the view across steps, and a trace is the view inside one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode

from sft_runtime.traces.context import TRACER

DRIVER_SPAN = "rl.sft_v2.driver"
JOB_SPAN = "rl.sft_v2.job"
STEP_SPAN = "rl.sft_v2.step"
POLICY_TRAINING_SPAN = "rl.sft_v2.policy_training"
START_STEP_SPAN = "rl.sft_v2.start_step"  # a worker's first call of a step (load, forward)
SAVE_SPAN = "rl.sft_v2.save"
# a step's parts, in the worker (under START_STEP_SPAN or the finish call) and the controller
LOAD_SPAN = "rl.sft_v2.load"  # the loader delivers the step's batch
LOADER_COMMIT_SPAN = "rl.sft_v2.loader_commit"  # the previous step's batch is committed
BEGIN_STEP_SPAN = "rl.sft_v2.begin_step"  # the global token count (a collective)
FORWARD_BACKWARD_SPAN = "rl.sft_v2.forward_backward"
FINISH_STEP_SPAN = "rl.sft_v2.finish_step"  # gradients, clipping, the optimizer step
ALLREDUCE_SPAN = "rl.sft_v2.allreduce"
READ_AHEAD_SPAN = "rl.sft_v2.read_ahead"  # the next batch, read during the all-reduce
OPTIMIZER_SPAN = "rl.sft_v2.optimizer"
EVENT_APPEND_SPAN = "rl.sft_v2.event_append"  # the controller appends step_committed
VALIDATION_SPAN = "rl.sft_v2.validation"  # a validation pass, in the controller
VALIDATION_WORKER_SPAN = "rl.sft_v2.validation.worker"  # one worker's share of it
JOB_TRACE_ATTR = "sft.job.trace_id"
# Start-up, so "why did my resume take 40 s" is answered in the job trace's timeline.
SETUP_SPANS = {
    "check": "rl.sft_v2.setup.check",  # data set, model folder, tokenizer, run lock
    "resume": "rl.sft_v2.setup.find_resume",  # log replay and checkpoint checks
    "ray": "rl.sft_v2.setup.ray",  # start or join Ray
    "workers": "rl.sft_v2.setup.workers",  # placement, actors, process group, weights
    "open_log": "rl.sft_v2.setup.open_log",  # the controller opens (and repairs) the log
    "loaders": "rl.sft_v2.setup.loaders",  # workers' telemetry, loaders, restored states
}
PHASE_ATTR = "sft.step.phase"  # the step phase a span belongs to (`states.machine.StepPhase`)


def record_error(span: Span, exc: BaseException) -> None:
    """Record the exception as a span event and set an ERROR status naming it.

    Once per span: a span already marked ERROR (say, by the body before it re-raised into
    `traced`) is left alone, so an error is never recorded twice.
    """
    status = getattr(span, "status", None)  # SDK spans expose it; API spans do not
    if getattr(status, "status_code", None) is StatusCode.ERROR:
        return
    if span.is_recording():
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))


def set_attributes_lazily(span: Span, build: Callable[[], Mapping[str, Any]]) -> None:
    """Compute attributes only when the span records (with telemetry off it never does)."""
    if span.is_recording():
        span.set_attributes(dict(build()))


class traced:  # noqa: N801 - used as a function: ``with traced(name, ...) as span``
    """A current span, under the remote caller's context when a carrier is given.

    Any exception escaping the body (KeyboardInterrupt too) is recorded on the span with an
    ERROR status and re-raised unchanged. ``root`` starts a new trace, ignoring both the
    carrier and the current span.

    A class rather than a generator: it is entered about ten times a step in every process,
    and the SDK's own context managers (and one of ours per concern) cost as much again as
    the span itself.
    """

    __slots__ = ("_args", "_span", "_tokens")

    def __init__(
        self,
        name: str,
        *,
        carrier: dict[str, str] | None = None,
        attributes: Mapping[str, Any] | None = None,
        links: list[Link] | None = None,
        root: bool = False,
        start_time: int | None = None,
    ) -> None:
        self._args = (name, carrier, attributes, links, root, start_time)

    def __enter__(self) -> Span:
        name, carrier, attributes, links, root, start_time = self._args
        tokens = []
        if carrier and not root:
            tokens.append(otel_context.attach(propagate.extract(carrier)))
        span = TRACER.start_span(
            name,
            context=otel_context.Context() if root else None,
            attributes=_clean(attributes),
            links=links,
            start_time=start_time,
            record_exception=False,
            set_status_on_exception=False,
        )
        tokens.append(otel_context.attach(trace.set_span_in_context(span)))
        self._span, self._tokens = span, tokens
        return span

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        span = self._span
        try:
            if exc is not None and exc_type is not GeneratorExit:
                record_error(span, exc)
        finally:
            for token in reversed(self._tokens):
                otel_context.detach(token)
            span.end()
        return False


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """OTel rejects None values (with a warning per call): drop them up front."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}


def _span_context(job: Span | SpanContext | None) -> SpanContext:
    if job is None:
        return trace.get_current_span().get_span_context()
    if isinstance(job, SpanContext):
        return job
    return job.get_span_context()


@contextmanager
def step_span(
    step: int,
    *,
    attempt: int | None = None,
    job: Span | SpanContext | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span]:
    """A ``rl.sft_v2.step`` span as the current span, root of its own trace, linked to the
    job (default: the current span), ended on exit; errors are marked as in `traced`.

    For a step whose extent is known when it begins. The controller's steps, whose first
    calls go out before the previous step ends, use `traces.step_trace.StepTrace`.
    """
    job_ctx = _span_context(job)
    attrs: dict[str, Any] = {"step": step, "attempt": attempt}
    links = None
    if job_ctx.is_valid:
        links = [Link(job_ctx, {"sft.link": "job"})]
        attrs[JOB_TRACE_ATTR] = f"{job_ctx.trace_id:032x}"
    attrs.update(attributes or {})
    span = TRACER.start_span(
        STEP_SPAN,
        context=otel_context.Context(),
        attributes=_clean(attrs),
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    )
    with (
        trace.use_span(
            span, end_on_exit=True, record_exception=False, set_status_on_exception=False
        ),
        _errors_recorded(span),
    ):
        yield span


@contextmanager
def _errors_recorded(span: Span) -> Iterator[None]:
    """Any exception escaping the body (KeyboardInterrupt too) marks ``span`` as an error."""
    try:
        yield
    except GeneratorExit:
        raise
    except BaseException as exc:
        record_error(span, exc)
        raise

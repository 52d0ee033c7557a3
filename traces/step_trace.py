"""`StepTrace`: one step's trace, whose root span is drawn once the step's extent is known.

A step's first worker calls are often sent while the previous step is still running (queued
behind its finish), and they must carry their parent's id when they are sent. Opening the
root then would start the step's trace tens of milliseconds before anything of the step ran,
overlapping the step before. So the root's ids are reserved up front (`traces.ids`), the
step's work is parented to them through a placeholder, and the root itself is started and
ended afterwards with the times the step really began (the earliest worker call, or the
controller's first send) and ended. ``total_step_time_s`` is computed from the same two
instants, so the span's extent and its attribute agree.

The step's ``policy_training`` span (the controller's wait for the step's calls, parent of
each worker's finish) gets a reserved id too: a step sent ahead is sent whole, start and
finish in one call, before that span exists (`training_carrier`, then `training`).

Each root is a trace of its own, linked to the job span (see `traces.spans`). With telemetry
off nothing is reserved or drawn, and the placeholder is the API's invalid span.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import (
    INVALID_SPAN,
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    TraceFlags,
)

from sft_runtime.traces.context import TRACER, TRACER_NAME
from sft_runtime.traces.setup import active_telemetry
from sft_runtime.traces.spans import (
    JOB_TRACE_ATTR,
    POLICY_TRAINING_SPAN,
    STEP_SPAN,
    record_error,
)


@dataclass(frozen=True)
class TraceOrigin:
    """What the step traces of one attempt share: the attempt, the job span each step's root
    links to, and this process's id reserver (None with telemetry off), looked up once when
    the job span opens rather than for every step."""

    attempt: int | None = None
    job: Span | None = None
    ids: Any = None

    @classmethod
    def of_job(cls, attempt: int | None, job: Span | None) -> TraceOrigin:
        telemetry = active_telemetry()
        return cls(attempt, job, getattr(telemetry, "ids", None) if telemetry else None)


class StepTrace:
    """The trace of step ``step``: reserved ids, its start, attributes, error, then the root."""

    def __init__(self, step: int, origin: TraceOrigin, *, sent_ahead: bool = False) -> None:
        attempt, job = origin.attempt, origin.job
        self.step = step
        self.sent_ns = time.time_ns()  # nothing of the step can begin before this
        self.started_ns: int | None = None
        self.attributes: dict[str, Any] = {
            "step": step,
            "attempt": attempt,
            "sft.sent_ahead": sent_ahead,
        }
        self.error: BaseException | None = None
        self._job = job.get_span_context() if job is not None else None
        self._ids = origin.ids
        self._reserved: tuple[int, int] | None = None
        self._training: tuple[int, int] | None = None  # the policy_training span's ids
        self.placeholder: Span = INVALID_SPAN
        if self._ids is not None:
            self._reserved = self._ids.reserve()
            trace_id, span_id = self._reserved
            self._training = (trace_id, self._ids.reserve()[1])
            flags = TraceFlags(TraceFlags.SAMPLED)
            self.placeholder = NonRecordingSpan(SpanContext(trace_id, span_id, False, flags))
        self._ended = False

    @property
    def recording(self) -> bool:
        return self._reserved is not None

    @property
    def ids(self) -> tuple[str | None, str | None]:
        """(trace id, span id) of the root, as hex (None with telemetry off)."""
        if self._reserved is None:
            return None, None
        return f"{self._reserved[0]:032x}", f"{self._reserved[1]:016x}"

    def carrier(self) -> dict[str, str]:
        """A W3C carrier whose parent is this step's root (for worker calls)."""
        carrier: dict[str, str] = {}
        if self.recording:
            propagate.inject(carrier, context=trace.set_span_in_context(self.placeholder))
        return carrier

    def training_carrier(self) -> dict[str, str]:
        """A W3C carrier whose parent is this step's ``policy_training`` span (for the
        finish), before that span is started by `training`."""
        carrier: dict[str, str] = {}
        if self._training is not None:
            flags = TraceFlags(TraceFlags.SAMPLED)
            span = NonRecordingSpan(SpanContext(*self._training, False, flags))
            propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    @contextmanager
    def training(self) -> Iterator[None]:
        """The step's ``policy_training`` span around the controller's wait for the step,
        with the id `training_carrier` promised. It is drawn at the end, from the step's
        start: a step sent ahead may have begun (and its finish with it) in the workers
        before the controller got to it."""
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            if self._training is not None:
                self._draw(POLICY_TRAINING_SPAN, self._training, error)

    def _draw(self, name: str, ids: tuple[int, int], error: BaseException | None) -> None:
        end = time.time_ns()
        start = min(self.started_ns or self.sent_ns, end)
        with self._ids.use(ids), trace.use_span(self.placeholder, end_on_exit=False):
            span = TRACER.start_span(name, start_time=start, record_exception=False)
        if error is not None:
            record_error(span, error)
        span.end(end_time=end)

    @contextmanager
    def current(self) -> Iterator[Span]:
        """The root (as its placeholder) is the current span: spans made here are its children."""
        with trace.use_span(self.placeholder, end_on_exit=False):
            yield self.placeholder

    def began(self, at_ns: int | None = None) -> int:
        """The step's first piece of work began at ``at_ns`` (default: now), never before it
        was sent (a worker on another node may run a skewed clock); the earliest call wins."""
        at = max(self.sent_ns, time.time_ns() if at_ns is None else at_ns)
        self.started_ns = at if self.started_ns is None else min(self.started_ns, at)
        return self.started_ns

    def seconds_since_start(self, now_ns: int | None = None) -> float:
        now = time.time_ns() if now_ns is None else now_ns
        return max(0, now - (self.started_ns or self.sent_ns)) / 1e9

    def end(self, end_ns: int | None = None, attributes: Mapping[str, Any] | None = None) -> None:
        """Draw the root from the step's start to ``end_ns`` (default: now); once."""
        if self._ended or not self.recording:
            self._ended = True
            return
        self._ended = True
        end = time.time_ns() if end_ns is None else end_ns
        start = min(self.started_ns or self.sent_ns, end)
        attrs = {**self.attributes, **(attributes or {}), "total_step_time_s": (end - start) / 1e9}
        links = None
        if self._job is not None and self._job.is_valid:
            links = [Link(self._job, {"sft.link": "job"})]
            attrs[JOB_TRACE_ATTR] = f"{self._job.trace_id:032x}"
        with self._ids.use(self._reserved):
            span = TRACER.start_span(
                STEP_SPAN,
                context=otel_context.Context(),
                attributes={k: v for k, v in attrs.items() if v is not None},
                links=links,
                start_time=start,
                record_exception=False,
                set_status_on_exception=False,
            )
        if self.error is not None:
            record_error(span, self.error)
        span.end(end_time=end)


# --------------------------------------------------------------- the step's metric instruments
# Per-step OpenTelemetry instruments, on the API meter.
#
# The controller records each step's metric dict once; the instruments are created through
# ``metrics.get_meter``, so before `setup_telemetry` (or with telemetry off) they are proxies
# that cost next to nothing, and they start forwarding once a MeterProvider is set.
#
# Histogram buckets are given as advice on the instrument (``explicit_bucket_boundaries_
# advisory``) rather than as SDK views, so the API alone carries them: the SDK's default
# buckets assume milliseconds and would put every step time in the first bucket.


# Seconds: 1 ms .. 10 min, roughly 1-2.5-5 per decade.
SECONDS_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# Tokens per second: a CPU toy model (~100/s) up to a large GPU cluster (~10M/s).
TOKENS_PER_SECOND_BUCKETS: tuple[float, ...] = tuple(
    m * 10.0**e for e in range(2, 8) for m in (1.0, 2.5, 5.0)
)[:-2]


class MetricDescriptor(Protocol):
    """What `StepInstruments` needs of a teed metric (`runtime.sft_v2.TeedMetric` fits),
    read only (a frozen record fits)."""

    @property
    def key(self) -> str: ...
    @property
    def instrument(self) -> str: ...
    @property
    def unit(self) -> str: ...
    @property
    def description(self) -> str: ...


# Last-value instruments added here (not teed in the seed API): key, name, unit, description.
TRAINING_GAUGES: tuple[tuple[str, str, str, str], ...] = (
    ("loss", "rl.sft_v2.loss", "1", "Training loss of the last step"),
    ("grad_norm", "rl.sft_v2.grad_norm", "1", "Gradient norm of the last step"),
    ("lr", "rl.sft_v2.lr", "1", "Learning rate of the last step"),
)


def buckets_for(unit: str) -> tuple[float, ...] | None:
    """Explicit buckets for a unit we know; None keeps the SDK default."""
    if unit == "s":
        return SECONDS_BUCKETS
    if unit.endswith("/s"):
        return TOKENS_PER_SECOND_BUCKETS
    return None


class StepInstruments:
    """A histogram per teed descriptor, plus loss / grad_norm / lr gauges.

    ``record(metrics)`` records every known key present in the dict (others are ignored),
    so one call per step mirrors the logger's row. Pass ``meter`` to use a specific
    MeterProvider (tests); the default is the global API meter.
    """

    def __init__(self, descriptors: Iterable[MetricDescriptor], *, meter: Any = None) -> None:
        meter = meter if meter is not None else metrics.get_meter(TRACER_NAME)
        self._instruments: dict[str, Any] = {}
        self.units: dict[str, str] = {}
        for d in descriptors:
            self._instruments[d.key] = meter.create_histogram(
                d.instrument,
                unit=d.unit,
                description=d.description,
                explicit_bucket_boundaries_advisory=buckets_for(d.unit),
            )
            self.units[d.instrument] = d.unit
        for key, name, unit, description in TRAINING_GAUGES:
            if key not in self._instruments:
                self._instruments[key] = meter.create_gauge(
                    name, unit=unit, description=description
                )
                self.units[name] = unit

    @property
    def keys(self) -> list[str]:
        return list(self._instruments)

    def record(
        self, step_metrics: Mapping[str, Any], attributes: Mapping[str, Any] | None = None
    ) -> None:
        """Record the keys present; non-numeric or missing values are skipped, never raised."""
        attrs = dict(attributes) if attributes else None
        for key, instrument in self._instruments.items():
            value = step_metrics.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if hasattr(instrument, "record"):
                instrument.record(value, attributes=attrs)
            else:
                instrument.set(value, attributes=attrs)

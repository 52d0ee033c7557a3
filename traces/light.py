"""A tracer whose spans cost a few microseconds where they are made; the SDK exports them.

The SDK's tracer runs about 170 Python calls per span (sampler, attribute validation under a
lock, the span object, a second read-only copy of it at ``end``). Measured on these 2-core
VMs: 38 us a span warm, and about 200 us for the first spans after the process waited on
Ray, which is how the controller and the workers spend a step. A step makes about ten spans
in each process, so that was most of what tracing cost.

A `LightSpan` records only what a span is: name, ids, parent, times, attributes, links,
events and status, in slots. The SDK's own pieces do the rest, later and elsewhere: a
`ReadableSpans` exporter adapter builds the SDK's ``ReadableSpan`` (cleaning attributes as
the SDK does) in the batch processor's thread, just before the real exporter writes it.
So exporters, processors and tests see exactly the objects the SDK would have given them.

What differs from the SDK's tracer: spans are recorded unless their parent was not sampled
(the SDK's default ``ParentBased(ALWAYS_ON)``; ``OTEL_TRACES_SAMPLER`` is not read), span
limits are the SDK's defaults, and processors see a span at its end only (the SDK's
``on_start`` hook, which neither the batch nor the simple processor uses, is not called).
Imported only where the SDK is installed (`traces.setup`).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from sft_runtime.traces.ids import RunIdGenerator

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_MAX_ATTRIBUTES = 128  # the SDK's default span limits
_MAX_EVENT_ATTRIBUTES = 128
_time_ns = time.time_ns


class LightTracerProvider(trace.TracerProvider):
    """Hands out `LightTracer`s; ends spans into SDK span processors (batch or simple)."""

    def __init__(self, resource: Resource, id_generator: RunIdGenerator) -> None:
        self.resource = resource
        self.id_generator = id_generator
        self.processors: tuple[Any, ...] = ()

    def add_span_processor(self, processor: Any) -> None:
        self.processors = (*self.processors, processor)

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Any = None,
    ) -> LightTracer:
        scope = InstrumentationScope(
            instrumenting_module_name, instrumenting_library_version, schema_url
        )
        return LightTracer(self, scope)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        done = True
        for processor in self.processors:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            done = processor.force_flush(left) and done
        return done

    def shutdown(self) -> None:
        for processor in self.processors:
            processor.shutdown()


class LightTracer(trace.Tracer):
    """Starts `LightSpan`s: the SDK tracer's ids and parenting, without its per-span work."""

    def __init__(self, provider: LightTracerProvider, scope: InstrumentationScope) -> None:
        self.provider = provider
        self.scope = scope

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        parent = trace.get_current_span(context).get_span_context()
        ids = self.provider.id_generator
        if parent.is_valid:
            if not parent.trace_flags.sampled:  # ParentBased: an unsampled trace stays so
                span_context = SpanContext(
                    parent.trace_id, ids.generate_span_id(), False, parent.trace_flags
                )
                return trace.NonRecordingSpan(span_context)
            trace_id, state = parent.trace_id, parent.trace_state
        else:
            trace_id, state, parent = ids.generate_trace_id(), None, None
        span_context = SpanContext(trace_id, ids.generate_span_id(), False, _SAMPLED, state)
        return LightSpan(
            self,
            name,
            span_context,
            parent,
            kind,
            dict(attributes) if attributes else {},
            tuple(links) if links else (),
            start_time if start_time is not None else _time_ns(),
        )

    @contextmanager
    def start_as_current_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


class LightSpan(trace.Span):
    """A recording span as plain fields; `readable` turns it into the SDK's span."""

    __slots__ = (
        "_tracer",
        "name",
        "context",
        "parent",
        "kind",
        "_attributes",
        "links",
        "_events",
        "status",
        "start_time",
        "end_time",
        "_readable",
    )

    def __init__(
        self,
        tracer: LightTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: tuple[Link, ...],
        start_time: int,
    ) -> None:
        self._tracer = tracer
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self._attributes = attributes
        self.links = links
        self._events: list[tuple[str, Any, int]] | None = None
        self.status = _UNSET
        self.start_time = start_time
        self.end_time: int | None = None
        self._readable: ReadableSpan | None = None

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is None:
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.end_time is None:
            self._attributes.update(attributes)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self.end_time is None:
            if self._events is None:
                self._events = []
            self._events.append((name, dict(attributes or {}), timestamp or _time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self.end_time is None and context.is_valid:
            self.links = (*self.links, Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """As the SDK: OK is final, UNSET is ignored."""
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return
        if not isinstance(status, Status):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """The SDK's ``exception`` event, with the same attribute names and values."""
        cls = type(exception)
        module = cls.__module__
        attrs: dict[str, Any] = {
            "exception.type": f"{module}.{cls.__qualname__}"
            if module and module != "builtins"
            else cls.__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        attrs.update(attributes or {})
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time if end_time is not None else _time_ns()
        for processor in self._tracer.provider.processors:
            processor.on_end(self)

    def readable(self) -> ReadableSpan:
        """The SDK's read-only span for this one (built once, in an exporter's thread)."""
        if self._readable is None:
            events = tuple(
                Event(name, BoundedAttributes(_MAX_EVENT_ATTRIBUTES, attrs), stamp)
                for name, attrs, stamp in self._events or ()
            )
            self._readable = ReadableSpan(
                name=self.name,
                context=self.context,
                parent=self.parent,
                resource=self._tracer.provider.resource,
                attributes=BoundedAttributes(_MAX_ATTRIBUTES, self._attributes, immutable=True),
                events=events,
                links=self.links,
                kind=self.kind,
                status=self.status,
                start_time=self.start_time,
                end_time=self.end_time,
                instrumentation_scope=self._tracer.scope,
            )
        return self._readable


class ReadableSpans(SpanExporter):
    """An SDK exporter fed `LightSpan`s: it receives the SDK's spans built from them."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return self.exporter.export(
            [s.readable() if isinstance(s, LightSpan) else s for s in spans]
        )

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.exporter.force_flush(timeout_millis)

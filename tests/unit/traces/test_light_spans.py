"""The light tracer gives exporters the spans the SDK's tracer would have given them.

The same script of span operations runs once on the SDK's ``TracerProvider`` and once on
`LightTracerProvider`, each into an in-memory exporter; the exported spans must agree field
by field (ids and times aside, which differ by construction), parent links included.
"""

from __future__ import annotations

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from sft_runtime.traces.ids import RunIdGenerator
from sft_runtime.traces.light import LightSpan, LightTracerProvider, ReadableSpans

RESOURCE = Resource.create({"service.name": "light-test", "sft.role": "controller"})


def _script(tracer: trace.Tracer, job: SpanContext) -> None:
    """Roots, children through the context, remote parents, links, attributes set late,
    events, an error, an OK status that later calls cannot change, a renamed span."""
    with tracer.start_as_current_span("root", attributes={"step": 3, "phase": "x"}) as root:
        root.set_attribute("loss", 1.5)
        root.set_attributes({"tokens": 7, "flags": [1, 2]})
        with tracer.start_as_current_span("child", kind=SpanKind.CLIENT) as child:
            child.add_event("mark", {"n": 1}, timestamp=123)
            child.update_name("child.renamed")
        try:
            with tracer.start_as_current_span("failing"):
                raise ValueError("bad batch")
        except ValueError:
            pass
        ok = tracer.start_span("ok", links=[Link(job, {"sft.link": "job"})])
        ok.set_status(Status(StatusCode.OK))
        ok.set_status(StatusCode.ERROR, "ignored: OK is final")
        ok.end()
        ok.set_attribute("after_end", True)  # ignored on an ended span
        ok.end()  # a second end is a no-op
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    tracer.start_span("remote_child", context=ctx, start_time=10, attributes={"a": None}).end(
        end_time=20
    )
    unsampled = SpanContext(0xABC, 0x123, is_remote=True, trace_flags=TraceFlags(0))
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(unsampled))
    dropped = tracer.start_span("unsampled_child", context=ctx)
    assert not dropped.is_recording()
    dropped.end()
    tracer.start_span("new_root", context=otel_context.Context()).end()


def _view(spans: list[ReadableSpan]) -> list[dict]:
    ids = {s.context.span_id: s.name for s in spans}

    def parent(s: ReadableSpan):
        if s.parent is None:
            return None
        return ids.get(s.parent.span_id, (s.parent.trace_id, s.parent.span_id, s.parent.is_remote))

    def event(e):
        attrs = dict(e.attributes)
        attrs.pop("exception.stacktrace", None)  # line numbers differ between the two runs
        return (e.name, attrs)

    return [
        {
            "name": s.name,
            "kind": s.kind,
            "parent": parent(s),
            "same_trace_as_parent": s.parent is None or s.parent.trace_id == s.context.trace_id,
            "attributes": dict(s.attributes),
            "events": [event(e) for e in s.events],
            "links": [(link.context.span_id, dict(link.attributes)) for link in s.links],
            "status": (s.status.status_code, s.status.description),
            "resource": dict(s.resource.attributes),
            "scope": s.instrumentation_scope.name,
            "timed": s.start_time <= s.end_time,
            "custom_times": (s.start_time, s.end_time) if s.name == "remote_child" else None,
        }
        for s in spans
    ]


def _run(provider, exporter: InMemorySpanExporter) -> list[dict]:
    job = SpanContext(0x1, 0x2, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    _script(provider.get_tracer("sft_runtime"), job)
    spans = list(exporter.get_finished_spans())
    assert all(type(s) is ReadableSpan for s in spans)  # what exporters are written for
    return _view(spans)


def test_light_spans_export_as_the_sdk_would():
    sdk_exporter, light_exporter = InMemorySpanExporter(), InMemorySpanExporter()
    sdk = TracerProvider(resource=RESOURCE, id_generator=RunIdGenerator(), shutdown_on_exit=False)
    sdk.add_span_processor(SimpleSpanProcessor(sdk_exporter))
    light = LightTracerProvider(RESOURCE, RunIdGenerator())
    light.add_span_processor(SimpleSpanProcessor(ReadableSpans(light_exporter)))
    expected, got = _run(sdk, sdk_exporter), _run(light, light_exporter)
    assert [s["name"] for s in got] == [
        "child.renamed",
        "failing",
        "ok",
        "root",
        "remote_child",
        "new_root",
    ]
    assert got == expected
    failing = next(s for s in got if s["name"] == "failing")
    assert failing["status"] == (StatusCode.ERROR, "ValueError: bad batch")
    assert failing["events"][0][1]["exception.type"] == "ValueError"


def test_batched_spans_are_built_in_the_exporters_thread_and_flushed():
    exporter = InMemorySpanExporter()
    light = LightTracerProvider(RESOURCE, RunIdGenerator())
    light.add_span_processor(
        BatchSpanProcessor(ReadableSpans(exporter), schedule_delay_millis=60_000)
    )
    tracer = light.get_tracer("sft_runtime")
    span = tracer.start_span("queued", attributes={"step": 1})
    assert isinstance(span, LightSpan)
    span.end()
    assert exporter.get_finished_spans() == ()  # queued, not yet built or exported
    assert light.force_flush(5_000)
    (done,) = exporter.get_finished_spans()
    assert type(done) is ReadableSpan and done.attributes == {"step": 1}
    light.shutdown()


def test_reserved_ids_go_to_the_next_root():
    exporter = InMemorySpanExporter()
    ids = RunIdGenerator()
    light = LightTracerProvider(RESOURCE, ids)
    light.add_span_processor(SimpleSpanProcessor(ReadableSpans(exporter)))
    tracer = light.get_tracer("sft_runtime")
    reserved = ids.reserve()
    with ids.use(reserved):
        root = tracer.start_span("step", context=otel_context.Context())
    other = tracer.start_span("other", context=otel_context.Context())
    assert (root.get_span_context().trace_id, root.get_span_context().span_id) == reserved
    assert other.get_span_context().span_id != reserved[1]


@pytest.mark.parametrize("value", [None, object(), [1, "mixed"]])
def test_invalid_attribute_values_end_as_with_the_sdk(value):
    """The SDK cleans attributes as it sets them, the light span when it is exported: the
    exported attributes are the same either way."""
    exported = []
    for provider_type in (TracerProvider, LightTracerProvider):
        exporter = InMemorySpanExporter()
        if provider_type is TracerProvider:
            provider = TracerProvider(resource=RESOURCE, shutdown_on_exit=False)
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            provider = LightTracerProvider(RESOURCE, RunIdGenerator())
            provider.add_span_processor(SimpleSpanProcessor(ReadableSpans(exporter)))
        span = provider.get_tracer("t").start_span("s", attributes={"ok": 1})
        span.set_attribute("bad", value)
        span.end()
        (done,) = exporter.get_finished_spans()
        exported.append(dict(done.attributes))
    assert exported[0] == exported[1]
    assert exported[1]["ok"] == 1
    if value is not None:  # cleaned as the SDK cleans it, never passed through as it was
        assert exported[1]["bad"] is not value

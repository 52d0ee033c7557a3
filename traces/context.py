"""The tracer, the meter, and the W3C carrier that takes span context across Ray calls.

Library code uses only the OpenTelemetry API: with no SDK installed every span is a
non-recording no-op that costs well under a microsecond.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

TRACER_NAME = "sft_runtime"
TRACER = trace.get_tracer(TRACER_NAME)


def inject_carrier(span: Any = None) -> dict[str, str]:
    """The current span context (or ``span``'s) as a W3C ``traceparent`` carrier (empty when
    none)."""
    carrier: dict[str, str] = {}
    context = None if span is None else trace.set_span_in_context(span)
    propagate.inject(carrier, context=context)
    return carrier


@contextmanager
def attached(carrier: dict[str, str] | None) -> Iterator[None]:
    """Run the body inside the remote caller's context (a no-op without a carrier)."""
    if not carrier:
        yield
        return
    token = otel_context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        otel_context.detach(token)


def span_ids(span: Any) -> tuple[str | None, str | None]:
    """(trace id, span id) as hex, or (None, None) for a non-recording span."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None, None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"

"""OpenTelemetry for sft-runtime: the API-only tracer and carrier, and lazy access to setup.

Importing this package loads only the OpenTelemetry API. `setup_telemetry` (which imports
the SDK when telemetry is on), `merge_trace_files` and the rest load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from traces.context import TRACER, TRACER_NAME, attached, inject_carrier, span_ids

_LAZY = {
    "Telemetry": "traces.setup",
    "setup_telemetry": "traces.setup",
    "active_telemetry": "traces.setup",
    "TelemetryConfig": "traces.config",
    "merge_trace_files": "traces.merge",
    "StepInstruments": "traces.metrics",
    "step_span": "traces.spans",
    "traced": "traces.spans",
    "record_error": "traces.spans",
}

__all__ = ["TRACER", "TRACER_NAME", "attached", "inject_carrier", "span_ids", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'traces' has no attribute {name!r}")
    return getattr(import_module(module), name)

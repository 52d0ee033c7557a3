"""OpenTelemetry for sft-runtime: the API-only tracer and carrier, and lazy access to setup.

Importing this package loads only the OpenTelemetry API. `setup_telemetry` (which imports
the SDK when telemetry is on), `merge_trace_files` and the rest load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from sft_runtime.traces.context import TRACER, TRACER_NAME, attached, inject_carrier, span_ids

_LAZY = {
    "Telemetry": "sft_runtime.traces.setup",
    "setup_telemetry": "sft_runtime.traces.setup",
    "active_telemetry": "sft_runtime.traces.setup",
    "TelemetryConfig": "sft_runtime.traces.config",
    "merge_trace_files": "sft_runtime.traces.merge",
    "StepInstruments": "sft_runtime.traces.metrics",
    "step_span": "sft_runtime.traces.spans",
    "traced": "sft_runtime.traces.spans",
    "record_error": "sft_runtime.traces.spans",
}

__all__ = ["TRACER", "TRACER_NAME", "attached", "inject_carrier", "span_ids", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'traces' has no attribute {name!r}")
    return getattr(import_module(module), name)

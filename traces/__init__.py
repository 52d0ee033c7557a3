"""OpenTelemetry for sft-runtime: the API-only tracer and carrier, and lazy access to setup.

Importing this package loads only the OpenTelemetry API. `setup_telemetry` (which imports
the SDK when telemetry is on), `merge_trace_files` and the rest load on first use.
"""

from __future__ import annotations

from typing import Any

from sft_runtime.traces.context import TRACER, TRACER_NAME, attached, inject_carrier, span_ids

_SETUP = ("Telemetry", "setup_telemetry", "active_telemetry")
_SPANS = ("step_span", "traced", "record_error")
_LAZY = (*_SETUP, "TelemetryConfig", "merge_trace_files", "StepInstruments", *_SPANS)

__all__ = ["TRACER", "TRACER_NAME", "attached", "inject_carrier", "span_ids", *_LAZY]


def __getattr__(name: str) -> Any:
    """A lazy name, from the module that defines it (imported here, on first use)."""
    if name in _SETUP:
        from sft_runtime.traces import setup as module
    elif name == "TelemetryConfig":
        from sft_runtime.traces import config as module
    elif name == "merge_trace_files":
        from sft_runtime.traces import merge as module
    elif name == "StepInstruments":
        from sft_runtime.traces import metrics as module
    elif name in _SPANS:
        from sft_runtime.traces import spans as module
    else:
        raise AttributeError(f"module 'traces' has no attribute {name!r}")
    return getattr(module, name)

"""The ``telemetry`` section. Lives in `traces/` so tracing setup needs nothing of `runtime/`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ExporterName = Literal["otlp", "jaeger_file", "console", "memory", "none"]
# The bound on a run's whole telemetry shutdown; also what a process flushes within when
# the run has no ``telemetry`` section (its handle may still be on, from an earlier run in
# the same program).
SHUTDOWN_TIMEOUT_S = 2.0


class TelemetryConfig(BaseModel):
    """Which OpenTelemetry exporters a run uses, and how long export may block."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    service_name: str = "sft-runtime"
    exporters: list[ExporterName] = Field(default_factory=lambda: ["jaeger_file"])
    otlp_endpoint: str | None = None  # falls back to OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT
    otlp_protocol: Literal["http/protobuf"] = "http/protobuf"
    # Each OTLP signal has its own switch and endpoint, as the SDK's conventions have them:
    # null follows OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER ("none" turns it off, on
    # otherwise); an endpoint here is the full URL of that signal (a traces-only backend
    # answers metrics with 405, so it gets `otlp_metrics: false`).
    otlp_traces: bool | None = None
    otlp_metrics: bool | None = None
    otlp_traces_endpoint: str | None = None
    otlp_metrics_endpoint: str | None = None
    export_timeout_s: float = Field(2.0, gt=0)
    shutdown_timeout_s: float = Field(SHUTDOWN_TIMEOUT_S, gt=0)
    jaeger_file_max_spans: int = Field(100_000, ge=1)

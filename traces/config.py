"""The ``telemetry`` section. Lives in `traces/` so tracing setup needs nothing of `runtime/`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ExporterName = Literal["otlp", "jaeger_file", "console", "memory", "none"]


class TelemetryConfig(BaseModel):
    """Which OpenTelemetry exporters a run uses, and how long export may block."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    service_name: str = "sft-runtime"
    exporters: list[ExporterName] = Field(default_factory=lambda: ["jaeger_file"])
    otlp_endpoint: str | None = None  # falls back to OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT
    otlp_protocol: Literal["http/protobuf"] = "http/protobuf"
    export_timeout_s: float = Field(2.0, gt=0)
    shutdown_timeout_s: float = Field(2.0, gt=0)
    jaeger_file_max_spans: int = Field(100_000, ge=1)

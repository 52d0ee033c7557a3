"""Per-step OpenTelemetry instruments, on the API meter.

The controller records each step's metric dict once; the instruments are created through
``metrics.get_meter``, so before `setup_telemetry` (or with telemetry off) they are proxies
that cost next to nothing, and they start forwarding once a MeterProvider is set.

Histogram buckets are given as advice on the instrument (``explicit_bucket_boundaries_
advisory``) rather than as SDK views, so the API alone carries them: the SDK's default
buckets assume milliseconds and would put every step time in the first bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from opentelemetry import metrics

from sft_runtime.traces.context import TRACER_NAME

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

"""`setup_telemetry`: the one place that imports the OpenTelemetry SDK and its exporters.

Every process of a run (driver, controller actor, each worker actor) calls it once with its
role, rank and attempt. Library code only ever uses the API (`traces.context.TRACER`, the
meter in `traces.step_trace`); until this runs, and forever when telemetry is off, those are
no-ops. The SDK is imported inside the functions below, not at module level, so importing
this module (or calling it with telemetry off) loads nothing of the SDK.

The global providers can be set once per process, so setup is idempotent: a second call
for the same run returns the first handle. A call for another run (an embedding program's
next `run_training`, in another run directory or attempt) closes the first run's exporters
and points the process's one tracer provider at the new run's resource and exporters, so
each run's trace holds its own driver's spans and no other's.

Shutdown and flush are bounded by ``shutdown_timeout_s`` even when an OTLP collector is
down: the SDK's own flush ignores its timeout argument, so the work runs in a daemon thread
that is abandoned when the bound passes.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sft_runtime.traces.config import SHUTDOWN_TIMEOUT_S, TelemetryConfig

_LOCK = threading.Lock()
_ACTIVE: Telemetry | None = None
_TRACES_PATH, _METRICS_PATH = "v1/traces", "v1/metrics"
METRIC_EXPORT_INTERVAL_S = 10.0
GAVE_UP_SHUTDOWN_S = 0.1  # the last shutdown after a flush already found the collector down
# Room for a burst (a checkpoint's worth of steps) before the batch processor drops spans.
MAX_QUEUED_SPANS = 8192


@dataclass
class Telemetry:
    """What `setup_telemetry` installed in this process; a no-op handle when disabled.

    ``memory_exporter`` (an ``InMemorySpanExporter``) and ``metric_reader`` (an
    ``InMemoryMetricReader``) are set with the ``memory`` exporter, for tests.
    """

    enabled: bool = False
    role: str = ""
    rank: int | None = None
    attempt: int | None = None
    run_dir: Path | None = None
    config: TelemetryConfig | None = None
    tracer_provider: Any = None
    meter_provider: Any = None
    memory_exporter: Any = None
    metric_reader: Any = None
    span_exporters: list[Any] = field(default_factory=list)
    ids: Any = None  # the provider's `traces.ids.RunIdGenerator`
    closed: bool = False
    gave_up: bool = False  # a flush did not finish in time: the collector is down or stuck

    def force_flush(self, timeout_s: float | None = None, *, deadline: float | None = None) -> bool:
        """Push buffered spans and metrics out; True when done within the bound.

        ``deadline`` (unix seconds) binds processes that flush at once: the workers flush
        against the one deadline the controller set, and `flush_within` hands on what they
        left of it.
        """
        if not self.enabled or self.closed:
            return True
        bound = timeout_s if timeout_s is not None else self._bound()
        if deadline is not None:
            bound = max(0.0, min(bound, deadline - time.time()))

        def flush() -> None:
            millis = int(bound * 1000)
            self.tracer_provider.force_flush(millis)
            if self.meter_provider is not None:
                self.meter_provider.force_flush(millis)

        done = _bounded("flush telemetry", flush, bound)
        self.gave_up = self.gave_up or not done
        return done

    def flush_within(self, budget_s: float | None) -> float:
        """Flush within ``budget_s`` (None: the whole ``shutdown_timeout_s``); returns what
        is left of it, for the next process of the run's shutdown to spend. The processes
        flush one after another (the workers, the controller, the driver) on one budget,
        so a dead collector costs the run the bound once, while their other closing work
        (slow on a busy machine) spends none of it."""
        bound = self._bound() if budget_s is None else budget_s
        started = time.monotonic()
        self.force_flush(bound)
        return max(0.0, bound - (time.monotonic() - started))

    def shutdown(self) -> bool:
        """Flush and shut down the providers within ``shutdown_timeout_s``; idempotent.

        Returns False when the bound passed first (spans still queued are then lost,
        which is the price of never holding up the end of a run on a dead collector). After
        a flush that gave up, it does not wait a second time for the same dead collector.
        """
        if not self.enabled or self.closed:
            return True
        self.closed = True
        bound = GAVE_UP_SHUTDOWN_S if self.gave_up else self._bound()
        deadline = time.monotonic() + bound

        def stop() -> None:
            self.tracer_provider.shutdown()
            if self.meter_provider is not None:
                left = max(0.0, deadline - time.monotonic())
                self.meter_provider.shutdown(timeout_millis=left * 1000)

        return _bounded("shut down telemetry", stop, bound)

    @property
    def run(self) -> tuple[Path | None, int | None]:
        """The run directory and attempt whose spans this handle exports."""
        return self.run_dir, self.attempt

    def _close_spans(self) -> None:
        """Shut down this run's span exporters (sending what they hold) within the bound, and
        leave the meter provider, which is set once per process, to the next run."""
        if self.closed:
            return
        self.closed = True
        if self.enabled:
            bound = GAVE_UP_SHUTDOWN_S if self.gave_up else self._bound()
            _bounded("shut down telemetry", self.tracer_provider.shutdown, bound)

    def discard_files(self) -> None:
        """Shut down and remove the trace files this process wrote: a launch that was refused
        before its attempt began leaves no traces of an attempt the log never had."""
        self.shutdown()
        for exporter in self.span_exporters:
            for path in getattr(exporter, "paths", ()):
                path.unlink(missing_ok=True)
                for folder in (path.parent, path.parent.parent):  # parts/, then traces/
                    if folder.is_dir() and not any(folder.iterdir()):
                        folder.rmdir()

    def _bound(self) -> float:
        return self.config.shutdown_timeout_s if self.config is not None else SHUTDOWN_TIMEOUT_S


def _bounded(what: str, fn: Callable[[], None], timeout_s: float) -> bool:
    """Run fn in a daemon thread; give up waiting after timeout_s. Never raises."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below, never re-raised
            errors.append(exc)

    worker = threading.Thread(target=target, name=f"sft-telemetry-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        warnings.warn(f"could not {what} within {timeout_s:.1f} s", RuntimeWarning, stacklevel=3)
        return False
    if errors:
        exc = errors[0]
        warnings.warn(
            f"could not {what}: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3
        )
        return False
    return True


def active_telemetry() -> Telemetry | None:
    """The handle installed in this process, if any."""
    return _ACTIVE


def setup_telemetry(
    config: TelemetryConfig | None,
    *,
    role: str,
    rank: int | None = None,
    attempt: int | None = None,
    run_dir: str | Path | None = None,
    node: str | None = None,
) -> Telemetry:
    """Install the SDK with the configured exporters for this process and return its handle.

    With ``config`` None or disabled nothing is installed or imported and a no-op handle
    comes back (and a later call may still install). Once installed, a later call returns
    the same handle unless it names another run (``run_dir`` and ``attempt``), or the handle
    was shut down: then the new run takes over the process's tracer provider.
    """
    global _ACTIVE
    with _LOCK:
        rundir = Path(run_dir) if run_dir is not None else None
        active = _ACTIVE
        same_run = active is not None and (rundir is None or (rundir, attempt) == active.run)
        if active is not None and same_run and not active.closed:
            return active
        if active is not None:  # another run: its provider stays installed, exporting nothing
            active._close_spans()
            active.tracer_provider.processors = ()
        if config is None or not config.enabled or not _real_exporters(config):
            off = Telemetry(role=role, rank=rank, attempt=attempt, run_dir=rundir, config=config)
            if active is not None:
                off.tracer_provider = active.tracer_provider
                off.meter_provider = active.meter_provider
                _ACTIVE = off
            return off
        if active is None:
            atexit.register(_shutdown_active)
        _ACTIVE = _install(
            config,
            role=role,
            rank=rank,
            attempt=attempt,
            run_dir=rundir,
            node=node,
            installed=active,
        )
        return _ACTIVE


def _shutdown_active() -> None:
    if _ACTIVE is not None:
        _ACTIVE.shutdown()


def _real_exporters(config: TelemetryConfig) -> list[str]:
    return [name for name in dict.fromkeys(config.exporters) if name != "none"]


def service_name(config: TelemetryConfig, role: str) -> str:
    """``<service_name>.<role>``: Jaeger colours spans and counts services by this name, so
    the driver, the controller and the workers must not share one."""
    return f"{config.service_name}.{role}"


def resource_attributes(
    config: TelemetryConfig,
    role: str,
    rank: int | None,
    attempt: int | None,
    node: str | None = None,
) -> dict[str, Any]:
    """The attributes that tell processes apart in Jaeger ("process" tags) and OTLP backends,
    after OpenTelemetry's resource conventions: the service is the role, the instance the
    rank, host and pid; the rank, node and attempt are tags of their own to filter by."""
    pid = os.getpid()
    instance = role if rank is None else f"{role}-{rank}"
    attrs: dict[str, Any] = {
        "service.name": service_name(config, role),
        "service.namespace": config.service_name,
        "service.instance.id": f"{instance}-{socket.gethostname()}-{pid}",
        "sft.role": role,
        "sft.rank": rank,
        "sft.attempt": attempt,
        "sft.node_id": node,
        "host.name": socket.gethostname(),
        "process.pid": pid,
    }
    return {k: v for k, v in attrs.items() if v is not None}


def signal_on(flag: bool | None, env_var: str) -> bool:
    """An OTLP signal's switch: the config's when set, else the SDK's environment variable
    (``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: ``none`` is off)."""
    if flag is not None:
        return flag
    return os.environ.get(env_var, "").strip().lower() != "none"


def _signal_endpoint(base: str | None, path: str) -> str | None:
    """The config's endpoint may be a base URL (like ``OTEL_EXPORTER_OTLP_ENDPOINT``) or the
    full signal URL; None leaves the choice to the exporter, which reads the ``OTEL_*``
    variables (``..._TRACES_ENDPOINT`` as is, ``OTEL_EXPORTER_OTLP_ENDPOINT`` + path)."""
    if base is None:
        return None
    if base.rstrip("/").endswith(path):
        return base
    return f"{base.rstrip('/')}/{path}"


def _install(
    config: TelemetryConfig,
    *,
    role: str,
    rank: int | None,
    attempt: int | None,
    run_dir: Path | None,
    node: str | None = None,
    installed: Telemetry | None = None,
) -> Telemetry:
    """The SDK's exporters for this run; the providers are set globally once per process, so
    after an ``installed`` run the tracer provider is reused and its meter provider kept."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    from sft_runtime.traces.ids import RunIdGenerator
    from sft_runtime.traces.light import LightTracerProvider, ReadableSpans

    attrs = resource_attributes(config, role, rank, attempt, node)
    resource = Resource.create(attrs)
    ids = RunIdGenerator()
    if installed is None:
        tracer_provider = LightTracerProvider(resource, ids)  # spans cheap where they are made
    else:
        tracer_provider = installed.tracer_provider
        tracer_provider.resource, tracer_provider.id_generator = resource, ids
    handle = Telemetry(
        enabled=True,
        role=role,
        rank=rank,
        attempt=attempt,
        run_dir=run_dir,
        config=config,
        tracer_provider=tracer_provider,
        ids=ids,
    )
    timeout_ms = int(config.export_timeout_s * 1000)
    readers: list[Any] = []
    for name in _real_exporters(config):
        if name == "memory":
            from opentelemetry.sdk.metrics.export import InMemoryMetricReader
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )

            handle.memory_exporter = InMemorySpanExporter()
            tracer_provider.add_span_processor(
                SimpleSpanProcessor(ReadableSpans(handle.memory_exporter))
            )
            handle.metric_reader = InMemoryMetricReader()
            readers.append(handle.metric_reader)
            handle.span_exporters.append(handle.memory_exporter)
            continue
        if name == "otlp" and signal_on(config.otlp_metrics, "OTEL_METRICS_EXPORTER"):
            readers.append(_otlp_metric_reader(config))
        exporter = _span_exporter(name, config, attrs, attempt, run_dir)
        if exporter is None:  # otlp with its traces off, or jaeger_file without a run dir
            continue
        handle.span_exporters.append(exporter)
        tracer_provider.add_span_processor(
            BatchSpanProcessor(
                ReadableSpans(exporter),  # the SDK's spans are built in the batch's thread
                max_queue_size=MAX_QUEUED_SPANS,
                schedule_delay_millis=1000,
                export_timeout_millis=timeout_ms,
            )
        )
    if installed is not None:
        handle.meter_provider = installed.meter_provider
        return handle
    trace.set_tracer_provider(tracer_provider)
    if readers:
        from opentelemetry.sdk.metrics import MeterProvider

        handle.meter_provider = MeterProvider(
            metric_readers=readers, resource=resource, shutdown_on_exit=False
        )
        metrics.set_meter_provider(handle.meter_provider)
    return handle


def _span_exporter(
    name: str,
    config: TelemetryConfig,
    attrs: dict[str, Any],
    attempt: int | None,
    run_dir: Path | None,
) -> Any:
    if name == "otlp":
        if not signal_on(config.otlp_traces, "OTEL_TRACES_EXPORTER"):
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(
            endpoint=config.otlp_traces_endpoint
            or _signal_endpoint(config.otlp_endpoint, _TRACES_PATH),
            timeout=config.export_timeout_s,
        )
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name == "jaeger_file":
        if run_dir is None:
            warnings.warn(
                "telemetry exporter jaeger_file needs a run directory; spans not written",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        from sft_runtime.traces.jaeger_file import JaegerFileExporter

        return JaegerFileExporter(
            run_dir,
            process_key=f"{attrs['service.instance.id']}-{time.time_ns()}",
            service_name=attrs["service.name"],
            resource_attributes=attrs,
            attempt=attempt,
            max_spans=config.jaeger_file_max_spans,
        )
    raise ValueError(f"unknown telemetry exporter {name!r}")


def _otlp_metric_reader(config: TelemetryConfig) -> Any:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    exporter = OTLPMetricExporter(
        endpoint=config.otlp_metrics_endpoint
        or _signal_endpoint(config.otlp_endpoint, _METRICS_PATH),
        timeout=config.export_timeout_s,
    )
    return PeriodicExportingMetricReader(
        exporter,
        export_interval_millis=METRIC_EXPORT_INTERVAL_S * 1000,
        export_timeout_millis=config.export_timeout_s * 1000,
    )

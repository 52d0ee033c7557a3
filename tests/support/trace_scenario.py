"""Processes for the trace tests: each scenario runs in its own interpreter because the
OpenTelemetry global providers can be set only once per process.

Usage: python tests/support/trace_scenario.py NAME JSON_ARGS; prints one JSON line (the result).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sft_runtime.traces.config import TelemetryConfig  # noqa: E402
from sft_runtime.traces.context import TRACER, attached, inject_carrier, span_ids  # noqa: E402
from sft_runtime.traces.spans import JOB_SPAN, record_error, step_span, traced  # noqa: E402


def spawn(name: str, args: dict[str, Any]) -> subprocess.Popen:
    """Start another scenario process; its stdout carries the JSON result."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, __file__, name, json.dumps(args)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def driver(args: dict[str, Any]) -> dict[str, Any]:
    """A driver and controller in one process; two 'workers' in child processes."""
    from sft_runtime.traces.merge import merge_trace_files
    from sft_runtime.traces.setup import setup_telemetry

    cfg = TelemetryConfig(enabled=True, exporters=["jaeger_file"])
    tel = setup_telemetry(cfg, role="controller", attempt=1, run_dir=args["run_dir"])
    out: dict[str, Any] = {"steps": {}}
    with TRACER.start_as_current_span("rl.sft_v2.driver") as drv:
        with traced(JOB_SPAN) as job:
            carriers = []
            for step in (1, 2):
                with step_span(step, attempt=1, attributes={"loss": 1.0 / step}) as span:
                    with traced("rl.sft_v2.policy_training"):
                        carriers.append(inject_carrier())
                        time.sleep(0.002)
                    out["steps"][step] = span_ids(span)
            workers = [
                spawn("worker", {"run_dir": args["run_dir"], "rank": r, "carriers": carriers})
                for r in (0, 1)
            ]
            out["workers"] = [json.loads(w.communicate()[0]) for w in workers]
        out["job"] = span_ids(job)
    out["driver"] = span_ids(drv)
    out["shutdown_ok"] = tel.shutdown()
    out["merged"] = [str(p) for p in merge_trace_files(args["run_dir"])]
    return out


def worker(args: dict[str, Any]) -> dict[str, Any]:
    from sft_runtime.traces.setup import setup_telemetry

    cfg = TelemetryConfig(enabled=True, exporters=["jaeger_file"])
    tel = setup_telemetry(cfg, role="worker", rank=args["rank"], attempt=1, run_dir=args["run_dir"])
    spans = []
    for carrier in args["carriers"]:
        with attached(carrier):
            with TRACER.start_as_current_span("rl.sft_v2.worker.train_step") as span:
                with TRACER.start_as_current_span("rl.sft_v2.worker.forward_backward"):
                    time.sleep(0.001)
                try:
                    with traced("rl.sft_v2.worker.optimizer"):
                        raise ValueError("boom")
                except ValueError:
                    pass
            spans.append(span_ids(span))
    tel.shutdown()
    return {"spans": spans, "pid": os.getpid()}


def otlp(args: dict[str, Any]) -> dict[str, Any]:
    """Export a parent and a child span (and one metric) to the OTLP/HTTP endpoints given."""
    from opentelemetry import metrics

    from sft_runtime.traces.setup import setup_telemetry

    os.environ.update(args.get("env", {}))
    cfg = TelemetryConfig(
        enabled=True,
        exporters=["otlp", "memory"],
        otlp_endpoint=args.get("endpoint"),
        otlp_metrics=args.get("otlp_metrics"),
        otlp_traces_endpoint=args.get("traces_endpoint"),
        otlp_metrics_endpoint=args.get("metrics_endpoint"),
        export_timeout_s=args.get("export_timeout_s", 2.0),
        shutdown_timeout_s=args.get("shutdown_timeout_s", 2.0),
    )
    tel = setup_telemetry(cfg, role="worker", rank=3, attempt=2)
    metrics.get_meter("sft_runtime").create_counter("rl.sft_v2.test.count").add(1)
    with traced("parent", attributes={"step": 7, "note": "hello"}) as parent:
        with traced("child", attributes={"valid_tokens": 123}) as child:
            pass
    t0 = time.monotonic()
    ok = tel.shutdown()
    return {
        "parent": span_ids(parent),
        "child": span_ids(child),
        "produced": len(tel.memory_exporter.get_finished_spans()),
        "shutdown_s": time.monotonic() - t0,
        "shutdown_ok": ok,
    }


class _Descriptor:
    def __init__(self, key: str, instrument: str, unit: str, description: str) -> None:
        self.key, self.instrument, self.unit, self.description = key, instrument, unit, description


TEED = [  # the seed API's SFT_V2_TEED_METRICS, restated so this process needs no ray
    _Descriptor("loader_latency_max", "rl.sft_v2.loader.latency.max", "s", "loader"),
    _Descriptor("policy_time", "rl.sft_v2.policy.duration", "s", "policy"),
    _Descriptor("total_step_time", "rl.sft_v2.step.duration", "s", "step"),
    _Descriptor("valid_tokens_per_second", "rl.sft_v2.valid_tokens_per_second", "{token}/s", "tps"),
]


def memory(args: dict[str, Any]) -> dict[str, Any]:
    """The memory exporter: spans, the step helper, error marking and metrics."""
    from sft_runtime.traces.setup import setup_telemetry
    from sft_runtime.traces.step_trace import StepInstruments

    instruments = StepInstruments(TEED)  # created before setup: proxies must start forwarding
    cfg = TelemetryConfig(enabled=True, exporters=["memory"])
    tel = setup_telemetry(cfg, role="controller", attempt=1)
    again = setup_telemetry(TelemetryConfig(enabled=True, exporters=["console"]), role="x")
    with traced(JOB_SPAN) as job:
        with step_span(5, attempt=1):
            pass
        try:
            with step_span(6, attempt=1) as span:
                try:
                    raise RuntimeError("step failed")
                except RuntimeError as exc:
                    record_error(span, exc)  # as the controller does before it re-raises
                    raise
        except RuntimeError:
            pass
    for row in args["rows"]:
        instruments.record(row)
    spans = [
        {
            "name": s.name,
            "trace": f"{s.context.trace_id:032x}",
            "parent": None if s.parent is None else f"{s.parent.span_id:016x}",
            "links": [f"{link.context.span_id:016x}" for link in s.links],
            "attributes": dict(s.attributes),
            "status": s.status.status_code.name,
            "events": [e.name for e in s.events],
            "resource": {k: v for k, v in s.resource.attributes.items() if k.startswith("sft.")},
        }
        for s in tel.memory_exporter.get_finished_spans()
    ]
    points: dict[str, Any] = {}
    data = tel.metric_reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                p = m.data.data_points[0]
                points[m.name] = {
                    "unit": m.unit,
                    "bounds": list(getattr(p, "explicit_bounds", []) or []),
                    "counts": list(getattr(p, "bucket_counts", []) or []),
                    "sum": getattr(p, "sum", None),
                    "count": getattr(p, "count", None),
                    "value": getattr(p, "value", None),
                }
    return {"same_handle": again is tel, "job": span_ids(job), "spans": spans, "points": points}


def disabled(args: dict[str, Any]) -> dict[str, Any]:
    """Telemetry off: the API alone, whatever the code calls."""
    from sft_runtime.traces.setup import setup_telemetry
    from sft_runtime.traces.step_trace import StepInstruments

    handles = [
        setup_telemetry(None, role="driver"),
        setup_telemetry(TelemetryConfig(enabled=False), role="worker", rank=0),
        setup_telemetry(TelemetryConfig(enabled=True, exporters=["none"]), role="worker"),
    ]
    with traced(JOB_SPAN) as job:
        with step_span(1, attempt=1) as step:
            carrier = inject_carrier()
    StepInstruments(TEED).record({"loss": 1.0, "policy_time": 0.1})
    for h in handles:
        h.force_flush()
        h.shutdown()
    return {
        "sdk_modules": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
        "recording": [job.is_recording(), step.is_recording()],
        "carrier": carrier,
        "enabled": [h.enabled for h in handles],
    }


if __name__ == "__main__":
    result = globals()[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)

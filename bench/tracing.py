"""Tracing cost: a realistic step with jaeger_file export on vs telemetry off, and us per span.

A step is one ``rl.sft_v2.step`` root span with 8 child spans (attributes on each, a carrier
injected as for a Ray call) around ~40 ms of simulated work (sleep: the controller mostly
waits on workers, so tracing cost sits on the critical path while the batch exporter's
thread works during the waits). A third configuration runs the same exporter and batch
processor under the SDK's own tracer instead of `traces.light`'s, to show what that one
saves. Each configuration runs in its own interpreter because the OpenTelemetry providers
are global.

Run: python bench/tracing.py [--steps 100] [--spans 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import zygote  # noqa: E402
from bench.harness import pick  # noqa: E402
from bench.table import Row, render  # noqa: E402

CHILDREN = ("load", "owner_call", "begin", "train", "finish", "metrics", "commit", "append")
WORK_S = 0.040
STEPS = pick(100, 5)
SPANS = pick(5_000, 200)
BARE_STEPS = pick(500, 20)  # steps with no work, for the tracing cost alone
ROUNDS = pick(5, 1)  # side-by-side runs of the three configurations
STEP_TARGET = 1.01  # traced step time against telemetry off
MODES = ("off", "on", "sdk")  # sdk: the SDK's own tracer, for comparison


def _child(mode: str, steps: int, spans: int) -> dict:
    """One configuration, measured in this (fresh) process."""
    from sft_runtime.traces.config import TelemetryConfig
    from sft_runtime.traces.context import TRACER, inject_carrier
    from sft_runtime.traces.setup import setup_telemetry
    from sft_runtime.traces.spans import set_attributes_lazily, step_span, traced

    run_dir = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    if mode == "sdk":  # the same exporter and batch processor under the SDK's own tracer
        from opentelemetry.sdk.trace import TracerProvider

        from sft_runtime.traces import light

        light.LightTracerProvider = lambda resource, ids: TracerProvider(
            resource=resource, id_generator=ids, shutdown_on_exit=False
        )
    on = mode in ("on", "sdk")
    cfg = TelemetryConfig(enabled=True, exporters=["jaeger_file"]) if on else None
    tel = setup_telemetry(cfg, role="controller", attempt=1, run_dir=run_dir)
    per_child = WORK_S / len(CHILDREN)

    def one_step(step: int, work_s: float) -> None:
        with step_span(step, attempt=1) as span:
            for name in CHILDREN:
                with traced(f"rl.sft_v2.{name}", attributes={"step": step, "phase": name}):
                    inject_carrier()
                    if work_s:
                        time.sleep(work_s)
            set_attributes_lazily(
                span, lambda: {"loss": 1.0, "valid_tokens": 4096, "consumed_samples": 32}
            )

    times = []
    with traced("rl.sft_v2.job"):
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            one_step(step, per_child)
            times.append(time.perf_counter() - t0)
        # the same step with no work: what tracing itself costs per step (warm caches)
        bare_steps = BARE_STEPS
        t0 = time.perf_counter()
        for step in range(bare_steps):
            one_step(step, 0.0)
        bare_step_us = (time.perf_counter() - t0) / bare_steps * 1e6
    # bare span cost: start + 3 attributes + end, no work
    t0 = time.perf_counter()
    for i in range(spans):
        with TRACER.start_as_current_span("rl.sft_v2.bench", attributes={"i": i, "a": "x"}) as s:
            s.set_attribute("b", 1.0)
    per_span_us = (time.perf_counter() - t0) / spans * 1e6
    t0 = time.perf_counter()
    tel.shutdown()
    shutdown_s = time.perf_counter() - t0
    parts = list((run_dir / "traces").rglob("*.jsonl"))
    size = sum(p.stat().st_size for p in parts)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "median_step_s": statistics.median(times),
        "bare_step_us": bare_step_us,
        "per_span_us": per_span_us,
        "shutdown_s": shutdown_s,
        "bytes": size,
        "span_total": (steps + bare_steps) * (len(CHILDREN) + 1) + spans + 1,
    }


def _spawn_all(steps: int, spans: int) -> tuple[dict, dict, dict]:
    """Telemetry off, on, and on under the SDK's own tracer, at once, so they see the same
    machine load (the work is sleep, so they hardly compete for a core)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    procs = [
        zygote.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--steps",
                str(steps),
                "--spans",
                str(spans),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in MODES
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"bench child failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results[0], results[1], results[2]


def run(steps: int = STEPS, spans: int = SPANS, rounds: int = ROUNDS) -> list[dict]:
    # every round runs the configurations side by side; the step-time figures are medians
    # over the rounds and the ratio the median of the rounds' ratios (the other rows come
    # from the round whose ratio is that median, or the upper one of the middle two)
    results = [_spawn_all(steps, spans) for _ in range(rounds)]
    ratios = [on["median_step_s"] / off["median_step_s"] for off, on, _ in results]
    sdk_ratios = [sdk["median_step_s"] / off["median_step_s"] for off, _, sdk in results]
    step_ratio = statistics.median(ratios)
    off, on, sdk = results[sorted(range(rounds), key=ratios.__getitem__)[rounds // 2]]
    off_step = statistics.median(off["median_step_s"] for off, _, _ in results)
    on_step = statistics.median(on["median_step_s"] for _, on, _ in results)
    sdk_step = statistics.median(sdk["median_step_s"] for _, _, sdk in results)
    per_step_bytes = on["bytes"] * (len(CHILDREN) + 1) / on["span_total"]
    rows = [
        Row(
            f"step time ({len(CHILDREN) + 1} spans, {WORK_S * 1e3:.0f} ms work), traced vs off",
            on_step * 1e3,
            "ms",
            reference=off_step * 1e3,
            ratio=step_ratio,
            target=f"<= {STEP_TARGET}x (median of {rounds})",
            ok=step_ratio <= STEP_TARGET,
        ),
        Row(
            "the same under the SDK's own tracer, vs off",
            sdk_step * 1e3,
            "ms",
            reference=off_step * 1e3,
            ratio=statistics.median(sdk_ratios),
        ),
        Row(
            f"tracing cost of one step, no work ({len(CHILDREN) + 1} spans)",
            on["bare_step_us"],
            "us",
            reference=off["bare_step_us"],
            ratio=on["bare_step_us"] / off["bare_step_us"],
        ),
        Row(
            "cost per span, installed (jaeger_file) vs API only",
            on["per_span_us"],
            "us",
            reference=off["per_span_us"],
            ratio=on["per_span_us"] / off["per_span_us"],
        ),
        Row(
            "cost per span, installed vs the SDK's own tracer (same exporter)",
            on["per_span_us"],
            "us",
            reference=sdk["per_span_us"],
            ratio=on["per_span_us"] / sdk["per_span_us"],
        ),
        Row("Jaeger JSON written per step (part files)", per_step_bytes, "bytes"),
        Row(
            f"shutdown with {spans} spans just queued (jaeger_file)",
            on["shutdown_s"],
            "s",
            target="<= shutdown_timeout_s (2 s)",
            ok=on["shutdown_s"] <= 2.0,
        ),
    ]
    return [r.as_dict() for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--spans", type=int, default=SPANS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--child", choices=MODES, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.steps, args.spans)), flush=True)
        return 0
    print(render(run(args.steps, args.spans, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

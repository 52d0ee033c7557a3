"""What a down OTLP collector costs a run's shutdown, against the promised bound.

The same short `sft-runtime train` three ways, side by side: telemetry off (the reference),
OTLP to a port where nothing listens (connections refused), and OTLP to a port that accepts
connections and never answers (a hung receiver, the worst case). The workers, the
controller and the driver flush on one budget of the shutdown bound, so the extra wall time
of a run should stay near ``shutdown_timeout_s`` (2 s) once, not once per process. Target: extra
<= the bound + 1.5 s of margin (the exporters' own connection handling, a loaded machine).
"""

from __future__ import annotations

import socket
import statistics
import sys
import time
from pathlib import Path

import yaml

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cli_runs, zygote  # noqa: E402
from bench import harness as h  # noqa: E402

BOUND_S = 2.0
MARGIN_S = 1.5
ROUNDS = h.pick(2, 1)
STEPS = h.pick(6, 3)
WORKERS = h.pick(2, 1)  # smoke: the driver, the controller and one worker still share it
# The collectors a run exports to beside the run with telemetry off (smoke: the hung one
# alone; a refused one goes through the same config, timing and row code, only the
# collector's answer differs)
COLLECTORS = h.pick(("refused", "hung"), ("hung",))


def _config(data: Path, run_dir: Path, endpoint: str | None) -> Path:
    from tests.support.small_run import small_raw

    raw = small_raw(run_dir, data, STEPS)
    raw["cluster"]["workers_per_node"] = WORKERS
    raw["telemetry"] = (
        {"enabled": False}
        if endpoint is None
        else {
            "enabled": True,
            "exporters": ["otlp"],
            "otlp_endpoint": endpoint,
            "export_timeout_s": 1.0,
            "shutdown_timeout_s": BOUND_S,
        }
    )
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _train(config: Path, run_dir: Path) -> float:
    t0 = time.monotonic()
    done = zygote.run(
        [str(cli_runs.CLI), "train", str(config), "--run-dir", str(run_dir)],
        env=cli_runs.cli_env("OTEL_"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"train failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.monotonic() - t0


def run() -> list[dict]:
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # accepted by the kernel, never answered
    endpoints = {
        "refused": f"http://127.0.0.1:{refused.getsockname()[1]}",
        "hung": f"http://127.0.0.1:{hung.getsockname()[1]}",
    }
    targets = {"off": None, **{name: endpoints[name] for name in COLLECTORS}}
    times: dict[str, list[float]] = {name: [] for name in targets}
    try:
        with h.workspace(ray=False, samples=512) as (data, tmp):
            for i in range(ROUNDS):
                for name, endpoint in targets.items():
                    run_dir = tmp / f"{name}-{i}"
                    times[name].append(_train(_config(data, run_dir, endpoint), run_dir))
                    print(
                        f"shutdown.py: round {i + 1}/{ROUNDS}: {name} {times[name][-1]:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        refused.close()
        hung.close()
    off = statistics.median(times["off"])
    rows = [h.row("shutdown.run_time.telemetry_off", off, "s")]
    target = f"<= {BOUND_S + MARGIN_S:.1f} s"
    for name in COLLECTORS:
        extra = statistics.median(t - o for t, o in zip(times[name], times["off"], strict=True))
        rows.append(
            h.row(
                f"shutdown.extra_time.collector_{name}",
                extra,
                "s",
                None,
                target,
                extra <= BOUND_S + MARGIN_S,
            )
        )
    return rows


if __name__ == "__main__":
    h.main(run, __doc__)

"""Span ids never repeat across runs or re-executions, and tracing never touches training.

The workers seed Python's `random` with the training seed (and a resume restores it); ids
drawn from it would repeat in every run of a config, and a backend keyed by id would keep
one run's spans and drop the other's. Each run here is the real CLI in its own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import torch
import yaml

from sft_runtime.events import read_log
from tests.support.small_run import small_raw

BIN = Path(sys.executable).parent / "sft-runtime"
STEPS = 4


def _train(run_dir: Path, data: Path, *, tracing: bool, fault: str | None = None) -> int:
    raw = small_raw(run_dir, data, STEPS)
    raw["checkpointing"]["save_period"] = 2
    raw["telemetry"] = {"enabled": tracing, "exporters": ["jaeger_file"]}
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "SFT_"))}
    env["RAY_AUTH_MODE"] = "disabled"
    if fault is not None:
        env["SFT_RUNTIME_FAULT"] = fault
    done = subprocess.run(
        [str(BIN), "train", str(config)], capture_output=True, text=True, env=env, timeout=300
    )
    return done.returncode


def _span_ids(run_dir: Path) -> set[str]:
    ids = set()
    for file in sorted((run_dir / "traces").glob("run-attempt*.json")):
        for trace in orjson.loads(file.read_bytes())["data"]:
            ids.update(span["spanID"] for span in trace["spans"])
    return ids


def _steps(run_dir: Path) -> list[dict]:
    return [r.data for r in read_log(run_dir) if r.type == "step_committed"]


def _rng_states(run_dir: Path) -> dict[str, dict]:
    return {
        str(path.relative_to(run_dir)): torch.load(path, weights_only=True)
        for path in sorted((run_dir / "checkpoints").rglob("rng/rank_*.pt"))
    }


def test_runs_share_no_span_id_and_tracing_leaves_training_alone(demo_data, tmp_path):
    a, b, off = tmp_path / "a", tmp_path / "b", tmp_path / "off"
    runs = ((a, True), (b, True), (off, False))
    with ThreadPoolExecutor(len(runs)) as pool:  # side by side: each mostly waits for Ray
        codes = list(pool.map(lambda run: _train(run[0], demo_data, tracing=run[1]), runs))
    assert codes == [0, 0, 0]
    ids_a, ids_b = _span_ids(a), _span_ids(b)
    assert len(ids_a) > 50 and len(ids_b) > 50
    assert not ids_a & ids_b  # the same config twice: not one id in common
    assert not (off / "traces").exists()
    # tracing on or off: the same losses, samples and saved RNG streams, bit for bit
    keep = ("step", "loss", "grad_norm", "sample_digests")
    assert [{k: s[k] for k in keep} for s in _steps(a)] == [
        {k: s[k] for k in keep} for s in _steps(off)
    ]
    rng_a, rng_off = _rng_states(a), _rng_states(off)
    assert sorted(rng_a) == sorted(rng_off) and rng_a
    for name in rng_a:
        saved, plain = rng_a[name], rng_off[name]
        assert saved["python"] == plain["python"], name
        assert torch.equal(saved["torch"], plain["torch"]), name
        assert torch.equal(saved["numpy"]["keys"], plain["numpy"]["keys"]), name


def test_a_re_executed_step_gets_new_ids(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    assert _train(run_dir, demo_data, tracing=True, fault="stepping:after_record@3") != 0
    assert _train(run_dir, demo_data, tracing=True) == 0
    by_step: dict[int, list[tuple[str, str]]] = {}
    for step in _steps(run_dir):
        by_step.setdefault(step["step"], []).append((step["trace_id"], step["span_id"]))
    assert by_step[3][0] != by_step[3][1] and len(by_step[3]) == 2  # lost with the kill, rerun
    trace_ids = [t for runs in by_step.values() for t, _ in runs]
    assert len(set(trace_ids)) == len(trace_ids)

"""A real run with the jaeger_file exporter: every step a trace across all processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import yaml

from sft_runtime.events import read_log
from sft_runtime.states import StepPhase
from tests.support.small_run import small_raw

BIN = Path(sys.executable).parent / "sft-runtime"


def test_a_run_writes_one_jaeger_trace_per_step_across_processes(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    raw = small_raw(run_dir, demo_data, 4)
    raw["telemetry"] = {"enabled": True, "exporters": ["jaeger_file"]}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_AUTH_MODE"] = "disabled"
    done = subprocess.run(
        [str(BIN), "train", str(config)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr

    merged = run_dir / "traces" / "run-attempt1.json"
    data = orjson.loads(merged.read_bytes())["data"]
    traces = {t["traceID"]: t for t in data}
    committed = [r.data for r in read_log(run_dir) if r.type == "step_committed"]
    assert len(committed) == 4
    for event in committed:
        trace = traces[event["trace_id"]]  # the log line leads to its trace
        spans = {s["spanID"]: s for s in trace["spans"]}
        root = spans[event["span_id"]]
        assert root["operationName"] == "rl.sft_v2.step"
        tags = {t["key"]: t["value"] for t in root["tags"]}
        assert tags["step"] == event["step"] and tags["loss"] == event["loss"]
        names = [s["operationName"] for s in trace["spans"]]
        for name in ("rl.sft_v2.load", "rl.sft_v2.forward_backward", "rl.sft_v2.allreduce"):
            assert names.count(name) == 2, (name, names)  # one per worker
        assert {"rl.sft_v2.policy_training", "rl.sft_v2.optimizer"} <= set(names)
        assert "rl.sft_v2.event_append" in names
        phases = {
            s["operationName"]: tag["value"]
            for s in trace["spans"]
            for tag in s["tags"]
            if tag["key"] == "sft.step.phase"
        }
        assert {  # the step's spans name their phase with the step's one vocabulary
            "rl.sft_v2.load": "loading",
            "rl.sft_v2.forward_backward": "train",
            "rl.sft_v2.finish_step": "train",
            "rl.sft_v2.event_append": "record",
        }.items() <= phases.items()
        assert set(phases.values()) <= {p.value for p in StepPhase}
        for span in trace["spans"]:  # every parent is in the same trace
            for ref in span["references"]:
                if ref["refType"] == "CHILD_OF":
                    assert ref["spanID"] in spans
        roles = {
            tag["value"]
            for process in trace["processes"].values()
            for tag in process["tags"]
            if tag["key"] == "sft.role"
        }
        assert roles == {"controller", "worker"}
    # every step's batch is committed once on each owner (by the next step's start, a
    # checkpoint or the close), and each commit is a span
    commits = [
        s for t in data for s in t["spans"] if s["operationName"] == "rl.sft_v2.loader_commit"
    ]
    assert len(commits) == 2 * len(committed)
    assert all(
        {"key": "sft.step.phase", "type": "string", "value": "commit"} in s["tags"] for s in commits
    )
    job_names = {s["operationName"] for t in data for s in t["spans"]}
    assert {"rl.sft_v2.driver", "rl.sft_v2.job", "rl.sft_v2.save"} <= job_names

    shown = subprocess.run(
        [str(BIN), "trace", str(run_dir), "--step", "2"], capture_output=True, text=True
    )
    assert shown.returncode == 0 and "rl.sft_v2.forward_backward" in shown.stdout

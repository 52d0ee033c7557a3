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
    sent_ahead = []
    for event in committed:
        trace = traces[event["trace_id"]]  # the log line leads to its trace
        spans = {s["spanID"]: s for s in trace["spans"]}
        root = spans[event["span_id"]]
        assert root["operationName"] == "rl.sft_v2.step"
        tags = {t["key"]: t["value"] for t in root["tags"]}
        assert tags["step"] == event["step"] and tags["loss"] == event["loss"]
        names = [s["operationName"] for s in trace["spans"]]
        for name in (
            "rl.sft_v2.load",
            "rl.sft_v2.forward_backward",
            "rl.sft_v2.allreduce",
            "rl.sft_v2.read_ahead",  # the next step's batch, read during the all-reduce
        ):
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
        services = {p["serviceName"] for p in trace["processes"].values()}
        assert services == {"sft-runtime.controller", "sft-runtime.worker"}
        _check_step_tree(trace, root, tags)
        sent_ahead.append(tags["sft.sent_ahead"])
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

    # step 1 starts in the controller; its finish carries step 2's start (no save at 1)
    assert sent_ahead[0] is False and sent_ahead[1] is True
    _check_job_trace(data)
    for process in (p for t in data for p in t["processes"].values()):
        keys = {tag["key"] for tag in process["tags"]}
        assert {"sft.role", "sft.attempt", "host.name", "service.instance.id"} <= keys, process

    shown = subprocess.run(
        [str(BIN), "trace", str(run_dir), "--step", "2"], capture_output=True, text=True
    )
    assert shown.returncode == 0 and "rl.sft_v2.forward_backward" in shown.stdout
    job = subprocess.run([str(BIN), "trace", str(run_dir), "--job"], capture_output=True, text=True)
    assert job.returncode == 0 and "rl.sft_v2.setup.find_resume" in job.stdout, job.stderr


def _check_step_tree(trace: dict, root: dict, tags: dict) -> None:
    """The step's work hangs under its own root, every child inside its parent, and the root
    spans exactly its work: it starts with the first piece of it, and its extent is the
    ``total_step_time_s`` it reports."""
    spans = {s["spanID"]: s for s in trace["spans"]}
    others = [s for s in trace["spans"] if s is not root]
    assert root["startTime"] == min(s["startTime"] for s in others)
    assert abs(root["duration"] - tags["total_step_time_s"] * 1e6) <= 1
    for span in others:
        [parent_id] = [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"]
        parent = spans[parent_id]
        assert parent["startTime"] <= span["startTime"], (span["operationName"], parent)
        end, parent_end = (x["startTime"] + x["duration"] for x in (span, parent))
        assert end <= parent_end + 1, (span["operationName"], parent["operationName"])
    names = {s["spanID"]: s["operationName"] for s in trace["spans"]}
    parent_of = {
        s["operationName"]: names[r["spanID"]]
        for s in others
        for r in s["references"]
        if r["refType"] == "CHILD_OF"
    }
    assert parent_of["rl.sft_v2.start_step"] == "rl.sft_v2.step"
    for name in ("rl.sft_v2.load", "rl.sft_v2.begin_step", "rl.sft_v2.forward_backward"):
        assert parent_of[name] == "rl.sft_v2.start_step", name
    assert parent_of["rl.sft_v2.finish_step"] == "rl.sft_v2.policy_training"
    assert parent_of["rl.sft_v2.read_ahead"] == "rl.sft_v2.allreduce"
    assert parent_of["rl.sft_v2.policy_training"] == "rl.sft_v2.step"


def _check_job_trace(data: list[dict]) -> None:
    """Start-up is traced: what the driver and the controller did before the first step."""
    [job] = [t for t in data if any(s["operationName"] == "rl.sft_v2.job" for s in t["spans"])]
    by_service: dict[str, set[str]] = {}
    for span in job["spans"]:
        service = job["processes"][span["processID"]]["serviceName"]
        by_service.setdefault(service, set()).add(span["operationName"])
    assert {
        "rl.sft_v2.driver",
        "rl.sft_v2.setup.check",
        "rl.sft_v2.setup.find_resume",
        "rl.sft_v2.setup.ray",
        "rl.sft_v2.setup.workers",
    } <= by_service["sft-runtime.driver"]
    assert {
        "rl.sft_v2.job",
        "rl.sft_v2.setup.open_log",
        "rl.sft_v2.setup.loaders",
        "rl.sft_v2.save",
    } <= by_service["sft-runtime.controller"]

"""Spans from three processes of one run land in one merged Jaeger file with intact parentage."""

from __future__ import annotations

from pathlib import Path

import orjson

from sft_runtime.traces.jaeger_json import PARTS_DIR
from sft_runtime.traces.merge import merge_trace_files


def _load(path: str | Path) -> list[dict]:
    return orjson.loads(Path(path).read_bytes())["data"]


def _spans_by_id(traces: list[dict]) -> dict[str, tuple[dict, dict]]:
    return {s["spanID"]: (s, t) for t in traces for s in t["spans"]}


def test_merge_writes_one_file_per_attempt_with_all_processes(traced_run):
    run_dir = traced_run["run_dir"]
    assert traced_run["shutdown_ok"]
    assert [Path(p).name for p in traced_run["merged"]] == ["run-attempt1.json"]
    parts = sorted((run_dir / "traces" / PARTS_DIR).glob("*.jsonl"))
    assert len(parts) == 3  # controller + two workers, one part each
    traces = _load(traced_run["merged"][0])
    # the job trace (driver + job) and one trace per step
    assert len(traces) == 3
    for t in traces:
        assert set(t) >= {"traceID", "spans", "processes"}
        for s in t["spans"]:
            assert set(s) >= {
                "traceID",
                "spanID",
                "operationName",
                "references",
                "startTime",
                "duration",
                "tags",
                "logs",
                "processID",
            }
            assert s["traceID"] == t["traceID"]
            assert s["processID"] in t["processes"]


def test_child_of_resolves_across_processes(traced_run):
    traces = _load(traced_run["merged"][0])
    spans = _spans_by_id(traces)
    for w in traced_run["workers"]:
        for (trace_id, span_id), step in zip(w["spans"], (1, 2), strict=True):
            span, trace = spans[span_id]
            assert span["operationName"] == "rl.sft_v2.worker.train_step"
            [ref] = span["references"]
            assert ref["refType"] == "CHILD_OF" and ref["traceID"] == trace_id
            parent, parent_trace = spans[ref["spanID"]]
            assert parent_trace is trace
            assert parent["operationName"] == "rl.sft_v2.policy_training"
            # the policy span's parent is the step span, root of this step's trace
            step_id = parent["references"][0]["spanID"]
            assert step_id == traced_run["steps"][str(step)][1]
            process = trace["processes"][span["processID"]]
            tags = {t["key"]: t["value"] for t in process["tags"]}
            assert tags["sft.role"] == "worker" and tags["process.pid"] == w["pid"]
    # each step trace names three processes: the controller and both workers
    for _, span_id in traced_run["steps"].values():
        _, trace = spans[span_id]
        assert len(trace["processes"]) == 3


def test_times_are_microseconds_and_children_nest(traced_run):
    traces = _load(traced_run["merged"][0])
    spans = _spans_by_id(traces)
    step, _ = spans[traced_run["steps"]["1"][1]]
    # a unix time in microseconds has 16 digits; the step slept ~2 ms in its child
    assert 10**15 < step["startTime"] < 10**17
    assert 1_000 < step["duration"] < 10_000_000
    for s, _ in spans.values():
        for ref in s["references"]:
            if ref["refType"] == "CHILD_OF":
                parent, _ = spans[ref["spanID"]]
                assert parent["startTime"] <= s["startTime"]


def test_step_trace_links_to_job_and_errors_are_tagged(traced_run):
    traces = _load(traced_run["merged"][0])
    spans = _spans_by_id(traces)
    job_trace, job_id = traced_run["job"]
    step, _ = spans[traced_run["steps"]["2"][1]]
    assert step["references"] == [
        {"refType": "FOLLOWS_FROM", "traceID": job_trace, "spanID": job_id}
    ]
    tags = {t["key"]: t["value"] for t in step["tags"]}
    assert tags["step"] == 2 and tags["attempt"] == 1 and tags["sft.job.trace_id"] == job_trace
    failed = [s for s, _ in spans.values() if s["operationName"] == "rl.sft_v2.worker.optimizer"]
    assert len(failed) == 4
    for s in failed:
        tags = {t["key"]: t["value"] for t in s["tags"]}
        assert tags["error"] is True and tags["otel.status_code"] == "ERROR"
        fields = {f["key"]: f["value"] for f in s["logs"][0]["fields"]}
        assert fields["event"] == "exception" and fields["exception.type"] == "ValueError"


def test_merge_again_is_stable(traced_run, tmp_path):
    first = _load(traced_run["merged"][0])
    again = merge_trace_files(traced_run["run_dir"])
    assert _load(again[0]) == first

"""The jaeger_file exporter and the merge, in process, on a private (non-global) provider."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

from sft_runtime.traces import merge as merge_module
from sft_runtime.traces.jaeger_file import JaegerFileExporter
from sft_runtime.traces.jaeger_json import PARTS_DIR, read_part_file, tag
from sft_runtime.traces.merge import merge_trace_files


def _exporter(run_dir: Path, max_spans: int, key: str = "worker-0-host-1") -> JaegerFileExporter:
    return JaegerFileExporter(
        run_dir,
        process_key=key,
        service_name="sft-runtime",
        resource_attributes={"sft.role": "worker", "sft.rank": 0},
        attempt=1,
        max_spans=max_spans,
    )


def _two_traces(run_dir: Path, max_spans: int) -> JaegerFileExporter:
    exporter = _exporter(run_dir, max_spans)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for _ in range(2):
        with tracer.start_as_current_span("root", attributes={"flag": True, "xs": [1, 2]}):
            for i in range(3):
                with tracer.start_as_current_span(f"child{i}") as span:
                    span.add_event("note", {"n": i})
    provider.shutdown()
    return exporter


def test_parts_rotate_by_span_count(tmp_path):
    exporter = _two_traces(tmp_path, max_spans=3)
    names = [p.name for p in exporter.paths]
    assert names == [f"worker-0-host-1.{i:04d}.jsonl" for i in (1, 2, 3)]
    counts = [len(read_part_file(p)[1]) for p in exporter.paths]
    assert counts == [3, 3, 2]
    header, _ = read_part_file(exporter.paths[1])
    assert header["serviceName"] == "sft-runtime" and header["attempt"] == 1


def test_merge_keeps_traces_whole_and_removes_stale_files(tmp_path):
    _two_traces(tmp_path, max_spans=3)
    paths = merge_trace_files(tmp_path, max_spans=5)
    assert [p.name for p in paths] == ["run-attempt1.json", "run-attempt1-2.json"]
    for p in paths:
        [trace] = orjson.loads(p.read_bytes())["data"]
        assert len(trace["spans"]) == 4
        assert trace["spans"][0]["operationName"] == "root"  # ordered by start time
        assert list(trace["processes"]) == ["p1"]
    assert [p.name for p in merge_trace_files(tmp_path)] == ["run-attempt1.json"]
    assert not (tmp_path / "traces" / "run-attempt1-2.json").exists()
    assert not list((tmp_path / "traces").glob(".*tmp*"))


def test_a_torn_last_line_is_skipped(tmp_path):
    exporter = _two_traces(tmp_path, max_spans=100)
    with open(exporter.paths[-1], "ab") as fh:
        fh.write(b'{"traceID": "ab", "spanID": "cd", "operat')
    [path] = merge_trace_files(tmp_path)
    [a, b] = orjson.loads(path.read_bytes())["data"]
    assert len(a["spans"]) + len(b["spans"]) == 8


def test_tags_logs_and_types(tmp_path):
    _two_traces(tmp_path, max_spans=100)
    [path] = merge_trace_files(tmp_path)
    trace = orjson.loads(path.read_bytes())["data"][0]
    root = trace["spans"][0]
    assert tag("flag", True) in root["tags"] and tag("xs", [1, 2]) in root["tags"]
    assert {"key": "xs", "type": "string", "value": "[1,2]"} in root["tags"]
    child = trace["spans"][1]
    assert child["references"][0]["spanID"] == root["spanID"]
    [log] = child["logs"]
    assert log["fields"][0] == {"key": "event", "type": "string", "value": "note"}
    assert {"key": "n", "type": "int64", "value": 0} in log["fields"]
    assert abs(log["timestamp"] - child["startTime"]) < 1_000_000
    assert tag("x", 1.5) == {"key": "x", "type": "float64", "value": 1.5}


def test_export_never_raises(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    exporter = _exporter(blocker, max_spans=10)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with pytest.warns(RuntimeWarning, match="jaeger_file exporter could not write"):
        with provider.get_tracer("t").start_as_current_span("s"):
            pass
    assert exporter.export([]) is SpanExportResult.SUCCESS  # nothing to write, no file needed
    provider.shutdown()
    assert exporter.export([]) is SpanExportResult.FAILURE  # after shutdown


def test_merge_of_a_run_without_traces_writes_nothing(tmp_path):
    assert merge_trace_files(tmp_path) == []
    (tmp_path / "traces" / PARTS_DIR).mkdir(parents=True)
    assert merge_trace_files(tmp_path) == []


def _write_part(run_dir: Path, key: str, attempt: int | None, spans: list[tuple]) -> None:
    parts = run_dir / "traces" / PARTS_DIR
    parts.mkdir(parents=True, exist_ok=True)
    header = {"process": {"key": key, "serviceName": "s", "tags": [], "attempt": attempt}}
    lines = [orjson.dumps(header)]
    for trace_id, span_id, start, step in spans:
        span = {
            "traceID": trace_id,
            "spanID": span_id,
            "operationName": "op",
            "references": [],
            "startTime": start,
            "duration": 1,
            "tags": [] if step is None else [tag("step", step)],
            "logs": [],
        }
        lines.append(orjson.dumps(span))
    (parts / f"{key}.0001.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def test_merge_splits_attempts_in_several_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(merge_module, "MAX_OPEN_SPOOLS", 1)
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    _write_part(tmp_path, "driver", None, [(c, "3" * 16, 300, None)])
    _write_part(tmp_path, "ctl1", 1, [(a, "1" * 16, 100, 1), (a, "4" * 16, 110, 1)])
    _write_part(tmp_path, "ctl2", 2, [(b, "2" * 16, 200, 1)])
    _write_part(tmp_path, "w", 1, [(a, "5" * 16, 105, None), (a, "5" * 16, 105, None)])
    paths = merge_trace_files(tmp_path, max_spans=1)
    assert [p.name for p in paths] == [
        "run-attempt1.json",
        "run-attempt2.json",
        "run-attempt2-2.json",
    ]
    [trace_a] = orjson.loads(paths[0].read_bytes())["data"]
    assert [s["spanID"] for s in trace_a["spans"]] == ["1" * 16, "5" * 16, "4" * 16]  # deduped
    assert len(trace_a["processes"]) == 2
    # the driver's trace names no attempt: it goes to the newest one
    assert orjson.loads(paths[2].read_bytes())["data"][0]["traceID"] == c
    assert not list((tmp_path / "traces").glob(".merge-spool*"))

"""Runs made one after another by one embedding program each keep their own driver's spans.

OpenTelemetry's providers are set once per process, so the driver of the second
`run_training` in a program reuses the first one's tracer provider. Its spans must still go
to its own run's trace (the job's root is the driver's), never to the run before, and a run
with telemetry off must write into no earlier run's files.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from sft_runtime.runtime.launch.driver import run_training
from tests.support.small_run import small_config

TRACED = ("++telemetry={enabled: true, exporters: [jaeger_file]}",)


def _driver_traces(run_dir: Path) -> set[str]:
    """The ids of the traces that hold this run's driver span."""
    data = orjson.loads((run_dir / "traces" / "run-attempt1.json").read_bytes())["data"]
    return {
        trace["traceID"]
        for trace in data
        for span in trace["spans"]
        if span["operationName"] == "rl.sft_v2.driver"
        and trace["processes"][span["processID"]]["serviceName"] == "sft-runtime.driver"
    }


def _written(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes() for p in (run_dir / "traces").rglob("*.jsonl")
    }


def test_each_run_of_an_embedding_program_keeps_its_own_drivers_spans(
    ray_session, demo_data, tmp_path
):
    one, off, two = tmp_path / "one", tmp_path / "off", tmp_path / "two"
    for run_dir, overrides in ((one, TRACED), (off, ()), (two, TRACED)):
        summary = run_training(small_config(run_dir, demo_data, 2, *overrides))
        assert summary["reason"] == "completed"
        if run_dir == one:
            first_files = _written(one)
    assert _written(one) == first_files  # the runs after it wrote nothing into its files
    assert not (off / "traces").exists()
    first, second = _driver_traces(one), _driver_traces(two)
    assert len(first) == 1 and len(second) == 1 and first != second
    for run_dir, own, other in ((one, first, second), (two, second, first)):
        text = b"".join(_written(run_dir).values())
        assert next(iter(own)).encode() in text
        assert next(iter(other)).encode() not in text  # not one span of the other run's driver

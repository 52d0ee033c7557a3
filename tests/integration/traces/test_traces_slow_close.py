"""A run whose close outlasts the telemetry shutdown bound keeps every process's spans.

The shutdown deadline exists so a dead collector costs a run its bound once; with a
collector that answers (here the file exporter), a close slower than the bound must cost
no process its spans, the driver's job root included.
"""

from __future__ import annotations

import time

import orjson

from tests.support.reliability import Runner

BOUND_S = 0.5
TELEMETRY = (
    f"++telemetry={{enabled: true, exporters: [jaeger_file], shutdown_timeout_s: {BOUND_S}}}"
)


def test_a_close_slower_than_the_shutdown_bound_keeps_the_controllers_and_drivers_spans(
    tmp_path, demo_data, launch_env
):
    ray_tmp, tag = launch_env
    runner = Runner(tmp_path, demo_data, ray_tmp, tag, steps=2, overrides=(TELEMETRY,))
    hold = tmp_path / "closing.hold"
    proc, proc_tag = runner.start("closing:before_stop", hold=hold)
    runner.wait_held(proc, proc_tag, hold)  # the workers flushed; the deadline is set
    held_at = hold.stat().st_mtime
    while time.time() <= held_at + BOUND_S:  # the deadline set before the hold has passed
        time.sleep(0.05)
    hold.unlink()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "could not flush telemetry" not in out, out[-4000:]

    data = orjson.loads((runner.run_dir / "traces" / "run-attempt1.json").read_bytes())["data"]
    by_service: dict[str, set[str]] = {}
    for trace in data:
        for span in trace["spans"]:
            service = trace["processes"][span["processID"]]["serviceName"]
            by_service.setdefault(service, set()).add(span["operationName"])
    assert "rl.sft_v2.driver" in by_service["sft-runtime.driver"]
    assert {"rl.sft_v2.job", "rl.sft_v2.step"} <= by_service["sft-runtime.controller"]
    assert "rl.sft_v2.forward_backward" in by_service["sft-runtime.worker"]

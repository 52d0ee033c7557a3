"""Two launches on one run directory never roll back each other's work.

Both launches of the same `sft-runtime train` command start together and would hold at
``driver:after_setup`` (the resume point read, the workers up, the controller not yet
started): the window in which two drivers used to read the same resume point and the later
one rolled back what the earlier committed. What the test waits for is what each launch
shows (its hold file, or its exit), never a clock: exactly one reaches the point, the other
is refused with one line naming the holder's driver pid and host, exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

from sft_runtime.events import read_log
from tests.support.reliability import LAUNCH_TIMEOUT_S, STEPS, reap

MISSING_DATA = "/nonexistent/sft-runtime-data"


def _decided(proc, hold) -> bool:
    return proc.poll() is not None or hold.exists()


def test_the_second_of_two_launches_is_refused_naming_the_first(make_runner, tmp_path):
    runner = make_runner("twice")
    holds = [tmp_path / "hold-a.json", tmp_path / "hold-b.json"]
    launches = [runner.start("driver:after_setup", hold=h) for h in holds]
    try:
        t0 = time.monotonic()
        while not all(_decided(p, h) for (p, _), h in zip(launches, holds, strict=True)):
            assert time.monotonic() - t0 < LAUNCH_TIMEOUT_S, "neither launch got anywhere"
            time.sleep(0.05)
        held = [i for i, h in enumerate(holds) if h.exists()]
        assert len(held) == 1, f"{len(held)} launches passed setup on one run directory"
        winner, loser = held[0], 1 - held[0]
        proc, _ = launches[loser]
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        assert proc.returncode == 2, out[-3000:]
        assert "Traceback" not in out
        errors = [line for line in out.splitlines() if "error" in line]
        assert len(errors) == 1, out
        driver = json.loads(holds[winner].read_text())["pid"]
        assert driver == launches[winner][0].pid  # the CLI process is the driver
        assert f"driver pid {driver} on host {socket.gethostname()}" in errors[0], errors[0]

        holds[winner].unlink()  # release the winner: it trains to the end
        proc, _ = launches[winner]
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        assert proc.returncode == 0, out[-3000:]
    finally:
        for proc, tag in launches:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
            reap(tag)

    records = list(read_log(runner.run_dir))
    assert {r.attempt for r in records} == {1}, "the refused launch wrote to the log"
    steps = [r.data["step"] for r in records if r.type == "step_committed"]
    assert steps == list(range(1, STEPS + 1))


def test_a_refused_launch_leaves_no_traces_of_an_attempt_the_log_never_had(make_runner):
    runner = make_runner(
        "refused",
        overrides=(
            "telemetry.enabled=true",
            f"data.train.path={MISSING_DATA}",
        ),
    )
    launch = runner.launch()
    assert launch.rc == 2, launch.tail()
    assert "not a prepared energon data set" in launch.output
    assert not (runner.run_dir / "traces").exists(), sorted(
        str(p) for p in (runner.run_dir / "traces").rglob("*")
    )

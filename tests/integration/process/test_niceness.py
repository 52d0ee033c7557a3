"""Every process a run places on Ray runs at ``cluster.worker_niceness`` (the controller
`CONTROLLER_OFFSET` nicer: it yields to the workers when a step begins).

Ray starts its worker processes at niceness 15: against any process at niceness 0 they get a
few percent of a core, so a controller left there stalls the whole run on a busy machine.
Both ways the runtime moves them are shown for real: an embedded Ray starts its workers at
the run's niceness, and the controller and the policy workers move themselves to it on a
cluster that started them elsewhere (the session's Ray, whose workers start at 0: moving up
to 3 needs no privileges, so the test runs as any user).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

from sft_runtime.events import read_log
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.process.faults import ENV, HOLD_ENV
from sft_runtime.runtime.process.heap import WORKER_HEAP
from sft_runtime.runtime.process.niceness import CONTROLLER_OFFSET, RAY_NICENESS_ENV
from tests.support.reliability import TAG_VAR
from tests.support.small_run import small_config

HOLD_BOUND_S = 600.0  # only a bound on a broken run; the test waits for the hold file

EMBEDDED = """
import json, os, sys
import ray
from sft_runtime.runtime.launch.setup import ensure_ray
from sft_runtime.runtime.policy.cluster_config import ClusterConfig

ensure_ray(ClusterConfig(worker_niceness=int(sys.argv[1])))

@ray.remote
def niceness_and_heap():
    heap = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    return {"worker": os.getpriority(os.PRIO_PROCESS, 0), "heap": heap}

print(json.dumps(ray.get(niceness_and_heap.remote())))
ray.shutdown()
"""


def _niceness(pid: int) -> set[int]:
    """The niceness of every thread of `pid` (on Linux each thread has its own)."""
    values = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        values.add(int(fields[16]))  # field 19 of stat, counted after the command name
    return values


def test_an_embedded_ray_starts_its_workers_at_the_run_niceness_with_the_worker_heap(
    launch_env,
):
    ray_tmp, tag = launch_env  # a short root for Ray's sockets; leftovers ended by tag
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_ADDRESS", "MALLOC_")) and k != RAY_NICENESS_ENV
    }
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(ray_tmp))
    env[TAG_VAR] = f"{tag}:embedded"
    out = subprocess.run(
        [sys.executable, "-c", EMBEDDED, "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # a task runs in a plain Ray worker, which nothing reniced after its start, and whose
    # heap variables came from the raylet's environment (runtime/process/heap.py)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert got == {"worker": 4, "heap": WORKER_HEAP if glibc else {}}


def test_the_controller_and_workers_move_to_the_run_niceness(
    ray_session, demo_data, tmp_path, monkeypatch
):
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    config = small_config(run_dir, demo_data, 3, "cluster.worker_niceness=3")
    # rank 0 holds inside step 2's forward/backward, so every process of the run is alive
    monkeypatch.setenv(ENV, "worker:train@2")
    monkeypatch.setenv(f"{ENV}_RANK", "0")
    monkeypatch.setenv(HOLD_ENV, str(hold))
    outcome: dict = {}
    mine = os.getpriority(os.PRIO_PROCESS, 0)

    def train() -> None:
        try:
            outcome["summary"] = run_training(config)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            outcome["error"] = exc

    runner = threading.Thread(target=train, daemon=True)
    runner.start()
    t0 = time.monotonic()
    while not hold.exists():
        assert runner.is_alive(), f"the run ended before holding: {outcome}"
        assert time.monotonic() - t0 < HOLD_BOUND_S, "the run never reached its hold point"
        time.sleep(0.05)
    worker_pid = json.loads(hold.read_text())["pid"]
    started = [r for r in read_log(run_dir) if r.type == "run_started"]
    controller_pid = started[-1].data["pid"]
    seen = {"worker": _niceness(worker_pid), "controller": _niceness(controller_pid)}
    hold.unlink()  # let the run go on
    runner.join(timeout=HOLD_BOUND_S)
    assert seen == {"worker": {3}, "controller": {3 + CONTROLLER_OFFSET}}
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["reason"] == "completed"
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the driver's process is left alone

"""A real two-node Ray cluster on this machine: `ray start --head` plus a second `ray start`.

One DP worker lands on each node; training stops, resumes, and matches the embedded
single-node run bit for bit. Both nodes are stopped at the end, also when a test fails.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from sft_runtime.events import read_log, records_in_effect
from sft_runtime.runtime.launch.driver import run_training
from tests.support.small_run import small_config, small_raw

BIN_DIR = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_AUTH_MODE"] = "disabled"
    return env


def _ray_processes(marker: str) -> list[int]:
    """Processes of this cluster: their command line or an open file names ``marker``.

    Read from /proc: `ps` cuts long command lines when piped, and Ray's agents rename
    themselves (``ray::DashboardAgent``) but keep their log files open under the temp dir.
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _mentions(entry, marker):
            pids.append(int(entry.name))
    return pids


def _mentions(proc: Path, marker: str) -> bool:
    try:
        if marker in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
            return True
        return any(marker in os.readlink(fd) for fd in (proc / "fd").iterdir())
    except OSError:
        return False


def _stop(marker: str) -> None:
    """Stop only this cluster's processes (never `ray stop`, which kills every Ray here)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _ray_processes(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while _ray_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def two_nodes():
    # a short root of its own: Ray's unix socket paths must stay under 108 bytes, and pytest's
    # temporary folders grow with each worker's name
    temp = Path(tempfile.mkdtemp(prefix="sftnodes-"))
    marker = str(temp)
    ray = str(BIN_DIR / "ray")
    common = ["--num-cpus=1", f"--temp-dir={temp}", "--disable-usage-stats"]
    try:
        head = _ray_start(ray, "--head", "--port=0", "--include-dashboard=false", *common)
        address = re.search(r"ray start --address='([^']+)'", head).group(1)
        _ray_start(ray, f"--address={address}", *common)
        yield address
    finally:
        _stop(marker)
        assert not _ray_processes(marker), "processes of the two-node cluster survived"
        shutil.rmtree(temp, ignore_errors=True)


def _ray_start(ray: str, *args: str) -> str:
    """`ray start` with ``args``; its output. A failure says what Ray printed."""
    done = subprocess.run(
        [ray, "start", *args], capture_output=True, text=True, env=_env(), timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"ray start {' '.join(args)} exited {done.returncode}:\n{output}"
    return output


def _train(config: Path, run_dir: Path, *overrides: str, timeout: float = 300):
    command = [str(BIN_DIR / "sft-runtime"), "train", str(config), "--run-dir", str(run_dir)]
    return subprocess.run(
        command + list(overrides), capture_output=True, text=True, env=_env(), timeout=timeout
    )


def _losses(run_dir: Path) -> dict[int, tuple[float, list[str]]]:
    return {
        r.data["step"]: (r.data["loss"], r.data["sample_digests"])
        for r in records_in_effect(read_log(run_dir))
        if r.type == "step_committed"
    }


def test_one_worker_per_node_stop_resume_equals_single_node(
    two_nodes, ray_session, demo_data, tmp_path
):
    run_dir = tmp_path / "multi"
    raw = small_raw(run_dir, demo_data, 6)
    raw["cluster"] = {
        "address": two_nodes,
        "num_nodes": 2,
        "workers_per_node": 1,
        "cpus_per_worker": 1.0,
        "placement_strategy": "SPREAD",
        "call_timeout_s": 120,
    }
    raw["checkpointing"]["checkpoint_dir"] = str(run_dir / "checkpoints")  # absolute, shared
    config = tmp_path / "multi.yaml"
    config.write_text(yaml.safe_dump(raw))

    first = _train(config, run_dir, "sft.max_num_steps=3")
    assert first.returncode == 0, first.stdout + first.stderr
    started = [r for r in read_log(run_dir) if r.type == "run_started"]
    node_ids = started[0].data["node_ids"]
    assert len(node_ids) == 2 and node_ids[0] != node_ids[1], node_ids

    second = _train(config, run_dir)  # the budget is 6 now: resumes from step 3
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from step 3" in second.stdout

    reference = tmp_path / "single"
    run_training(small_config(reference, demo_data, 6))
    assert _losses(run_dir) == _losses(reference)


def test_unreachable_address_fails_fast_with_exit_2(demo_data, tmp_path):
    config = tmp_path / "c.yaml"
    raw = small_raw(tmp_path / "run", demo_data, 2)
    raw["cluster"]["address"] = "127.0.0.1:1"
    raw["cluster"]["connect_timeout_s"] = 2
    config.write_text(yaml.safe_dump(raw))
    result = _train(config, tmp_path / "run", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cluster.address '127.0.0.1:1': nothing answers" in result.stderr


def test_missing_resources_fail_in_bounded_time_and_leave_nothing(two_nodes, demo_data, tmp_path):
    config = tmp_path / "c.yaml"
    raw = small_raw(tmp_path / "run", demo_data, 2)
    raw["cluster"] = {
        "address": two_nodes,
        "num_nodes": 2,
        "workers_per_node": 1,
        "cpus_per_worker": 4.0,  # each node has 1 CPU
        "placement_timeout_s": 3,
    }
    raw["checkpointing"]["checkpoint_dir"] = str(tmp_path / "run" / "checkpoints")
    config.write_text(yaml.safe_dump(raw))
    result = _train(config, tmp_path / "run", timeout=180)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "CPU: need 8" in result.stderr and "cluster.cpus_per_worker" in result.stderr
    probe = (
        f"import ray; ray.init(address={two_nodes!r}, logging_level='ERROR');"
        "from ray.util import placement_group_table as t;"
        "from ray._private.state import actors;"
        "live=[g for g in t().values() if g['state'] != 'REMOVED'];"
        "alive=[a for a in actors().values() if a['State'] == 'ALIVE'];"
        "print('LEFT', len(live), len(alive))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env())
    assert "LEFT 0 0" in out.stdout, out.stdout + out.stderr


def test_too_few_nodes_is_refused(two_nodes, demo_data, tmp_path):
    config = tmp_path / "c.yaml"
    raw = small_raw(tmp_path / "run", demo_data, 2)
    raw["cluster"] = {"address": two_nodes, "num_nodes": 3, "workers_per_node": 1}
    raw["policy"]["train_global_batch_size"] = 6  # splits over 3 ranks: only the nodes lack
    raw["checkpointing"]["checkpoint_dir"] = str(tmp_path / "run" / "checkpoints")
    config.write_text(yaml.safe_dump(raw))
    result = _train(config, tmp_path / "run", timeout=120)
    assert result.returncode == 2 and "has 2 live node(s)" in result.stderr, result.stderr

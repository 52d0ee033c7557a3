"""Nothing is left behind: no Ray session folder after a run, no superseded metrics rows.

`sft-runtime train` starts its own Ray, whose session folder (``<tmp>/ray/session_*``:
logs, sockets, spilled objects) stays after the run unless the run removes it. And a run
that was killed and resumed re-executes the steps after its checkpoint: metrics.jsonl must
then hold each step once, with the values of the execution that counts (the log's).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from sft_runtime.runtime.metrics.metrics_log import read_metrics
from tests.support.reliability import STEPS, Runner, committed


@pytest.fixture
def temp_root():
    """The launches' temporary directory (TMPDIR and RAY_TMPDIR), short for Ray's sockets."""
    root = Path(tempfile.mkdtemp(prefix="sftnlb-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _left(root: Path) -> list[str]:
    """What the launches left in their temporary directory. Ray's own root may stay, empty
    (other Rays on the machine may share it), and so may torch's per-user compile cache
    (``torchinductor_<user>``: one for every run of the user, not one per run)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p != root / "ray" and not p.relative_to(root).parts[0].startswith("torchinductor_")
    )


def _train(runner: Runner, root: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """Every process of the launch is gone (`Runner.cli`) before the folder is looked at."""
    return runner.cli(*runner.command[1:], fault=fault, env={"TMPDIR": str(root)})


def test_a_cli_run_leaves_no_ray_session_folder(tmp_path, demo_data, launch_env, temp_root):
    _, tag = launch_env
    runner = Runner(tmp_path, demo_data, temp_root, tag, name="clean", steps=3)
    done = _train(runner, temp_root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _left(temp_root) == []


def test_a_killed_and_resumed_run_has_one_metrics_row_per_step(
    tmp_path, demo_data, launch_env, temp_root
):
    _, tag = launch_env
    runner = Runner(tmp_path, demo_data, temp_root, tag, name="resumed")
    # killed while saving step 6: steps 4-6 have metrics rows, the resume starts at 3
    killed = _train(runner, temp_root, fault="saving:after_weights@6")
    assert killed.returncode == 1, killed.stdout[-3000:] + killed.stderr[-3000:]
    rows = read_metrics(runner.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    done = _train(runner, temp_root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from step 3" in done.stdout
    rows = read_metrics(runner.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    losses = {step: loss for step, (loss, _) in committed(runner.run_dir).items()}
    assert {r["step"]: r["train"]["loss"] for r in rows} == losses
    assert _left(temp_root) == []  # the killed launch's driver removed its folder too

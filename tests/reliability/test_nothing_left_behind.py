"""Nothing is left behind: nothing in the temporary directory after a run, no superseded
metrics rows.

`sft-runtime train` starts its own Ray, whose session folder (``<tmp>/ray/session_*``:
logs, sockets, spilled objects) stays after the run unless the run removes it; the metrics
backends' libraries (W&B's service socket and folders) leave theirs to exit hooks that the
killed controller actor never runs. And a run
that was killed and resumed re-executes the steps after its checkpoint: metrics.jsonl must
then hold each step once, with the values of the execution that counts (the log's).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sft_runtime.runtime.metrics.metrics_log import read_metrics
from tests.support.reliability import STEPS, Runner, committed
from tests.support.temp_root import fresh_temp_dir, left_behind


@pytest.fixture
def temp_root():
    """The launches' temporary directory (TMPDIR and RAY_TMPDIR)."""
    with fresh_temp_dir("sftnlb-") as root:
        yield root


def _train(runner: Runner, root: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """Every process of the launch is gone (`Runner.cli`) before the folder is looked at."""
    return runner.cli(*runner.command[1:], fault=fault, env={"TMPDIR": str(root)})


# every metrics backend a user can turn on: their libraries write temporary files too
BACKENDS = (
    "logger.tensorboard_enabled=true",
    "logger.wandb_enabled=true",
    "logger.mlflow_enabled=true",
)


def test_a_cli_run_with_every_backend_leaves_nothing_in_its_temporary_directory(
    tmp_path, demo_data, launch_env, temp_root
):
    _, tag = launch_env
    runner = Runner(tmp_path, demo_data, temp_root, tag, name="clean", steps=3, overrides=BACKENDS)
    done = _train(runner, temp_root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert left_behind(temp_root) == []


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
    assert left_behind(temp_root) == []  # the killed launch's driver removed its folder too

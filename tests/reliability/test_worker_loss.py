"""A worker killed mid-step, and a second run on a live run directory.

In-process runs on the session's Ray. The worker group is captured when the driver builds
it, so a thread can `ray.kill` a worker while the controller trains. When to act is decided
by the run itself: a fault point holds the run (``SFT_RUNTIME_FAULT_HOLD``) exactly where
the test wants it, and a thread acts once the hold file appears.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import yaml

from sft_runtime.events import read_log
from sft_runtime.events.errors import EventLogError
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.workers.group import PolicyWorkerGroup
from tests.support.reliability import PREFETCH, Reference, committed, compare, load_weights
from tests.support.small_run import small_config, small_raw

STEPS_LONG = 24  # checkpoints at 10, 20, 24
SAVE_EVERY = "checkpointing.save_period=10"
KILL_AT = 13  # rank 1 dies inside this step's forward/backward: steps 11 and 12 are lost


@pytest.fixture
def captured_groups(monkeypatch) -> list[PolicyWorkerGroup]:
    groups: list[PolicyWorkerGroup] = []
    original = PolicyWorkerGroup.__init__

    def capture(self, *args, **kwargs):
        original(self, *args, **kwargs)
        groups.append(self)

    monkeypatch.setattr(PolicyWorkerGroup, "__init__", capture)
    return groups


def stopped_error(records) -> str:
    return next(r.data["error"] for r in records if r.type == "run_stopped")


def _hold_at(monkeypatch, hold: Path, fault: str, rank: int | None = None) -> None:
    """The run (its controller and workers get these variables) holds at ``fault``."""
    monkeypatch.setenv("SFT_RUNTIME_FAULT", fault)
    monkeypatch.setenv("SFT_RUNTIME_FAULT_HOLD", str(hold))
    if rank is not None:
        monkeypatch.setenv("SFT_RUNTIME_FAULT_RANK", str(rank))


def _no_faults(monkeypatch) -> None:
    for name in ("SFT_RUNTIME_FAULT", "SFT_RUNTIME_FAULT_HOLD", "SFT_RUNTIME_FAULT_RANK"):
        monkeypatch.delenv(name, raising=False)


def _when_held(hold: Path, action, stop: threading.Event) -> threading.Thread:
    """Run ``action`` in a thread once the run holds (its hold file exists)."""

    def watch():
        while not stop.is_set():
            if hold.exists():
                action()
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("read_ahead", [(), PREFETCH], ids=["read_ahead_off", "read_ahead_on"])
def test_a_worker_killed_mid_step_aborts_fails_and_resumes_exactly(
    ray_session, demo_data, tmp_path, captured_groups, read_ahead, monkeypatch
):
    ref_dir = tmp_path / "reference"  # without read-ahead: it must not change the run
    run_training(small_config(ref_dir, demo_data, STEPS_LONG, SAVE_EVERY))
    reference = Reference(
        ref_dir, STEPS_LONG, committed(ref_dir), load_weights(ref_dir, STEPS_LONG)
    )

    run_dir = tmp_path / "run"
    config = small_config(run_dir, demo_data, STEPS_LONG, SAVE_EVERY, *read_ahead)
    stop, killed = threading.Event(), []
    hold = tmp_path / "held"
    _hold_at(monkeypatch, hold, f"worker:train@{KILL_AT}", rank=1)

    def kill_rank_1():
        group = captured_groups[-1]
        ray_session.kill(group.workers[1], no_restart=True)
        killed.append(KILL_AT)

    watcher = _when_held(hold, kill_rank_1, stop)
    try:
        with pytest.raises(Exception) as err:
            run_training(config)
    finally:
        stop.set()
        watcher.join(timeout=60)
        _no_faults(monkeypatch)
    assert killed, "the worker was never killed"
    assert not isinstance(err.value, (UserInputError, EventLogError))  # the CLI exits 1
    message = str(err.value)
    # The original error is rank 1's death; when rank 0's gloo error ("Connection reset by
    # peer") reaches the group first, that is what the run reports instead (a race).
    blamed = "rank 1: worker died" if "rank 1: worker died" in message else "peer's gloo error"
    assert blamed == "rank 1: worker died" or "Connection reset by peer" in message, message

    records = list(read_log(run_dir))
    aborted = [r for r in records if r.type == "step_aborted"]
    assert len(aborted) == 1, [(r.type, r.data.get("step")) for r in records]
    step = aborted[0].data["step"]
    assert step == KILL_AT
    assert aborted[0].data["error"] in stopped_error(records)
    committed_steps = [r.data["step"] for r in records if r.type == "step_committed"]
    assert committed_steps == list(range(1, step))
    stopped = [r for r in records if r.type == "run_stopped"]
    assert [s.data["reason"] for s in stopped] == ["failed"]
    assert aborted[0].data["error_type"] == "PolicyWorkerError"

    summary = run_training(small_config(run_dir, demo_data, STEPS_LONG, SAVE_EVERY, *read_ahead))
    assert summary["reason"] == "completed"
    assert summary["resumed_from_step"] == (10 * ((step - 1) // 10) or None)
    cmp = compare(run_dir, reference)
    print(
        f"\n[worker-kill] aborted step {step} (error blames {blamed}), "
        f"driver saw {type(err.value).__name__}, resumed from "
        f"{summary['resumed_from_step']}, steps_compared={cmp.steps_compared} "
        f"reexecuted_steps={cmp.reexecuted} mismatches={len(cmp.mismatches)}"
    )
    assert cmp.mismatches == []


def test_a_second_run_on_a_live_run_directory_is_refused(
    ray_session, demo_data, tmp_path, capsys, monkeypatch
):
    """The first run holds just after step 1 is durable; a second `train` on its directory
    is refused then, and the first run, released, finishes alone."""
    steps = 3
    run_dir = tmp_path / "run"
    first_config = small_config(run_dir, demo_data, steps)
    config_file = tmp_path / "second.yaml"
    config_file.write_text(yaml.safe_dump(small_raw(run_dir, demo_data, steps)))
    hold = tmp_path / "held"
    _hold_at(monkeypatch, hold, "stepping:after_record@1")
    outcome: dict = {}
    stop = threading.Event()

    def second_writer():
        try:
            capsys.readouterr()
            outcome["rc"] = cli_main(["train", str(config_file), "--run-dir", str(run_dir)])
            outcome["err"] = capsys.readouterr().err
            outcome["steps_meanwhile"] = sorted(committed(run_dir))
        finally:
            hold.unlink()  # release the first run

    watcher = _when_held(hold, second_writer, stop)
    try:
        summary = run_training(first_config)
    finally:
        stop.set()
        watcher.join(timeout=60)
        _no_faults(monkeypatch)
    assert summary["reason"] == "completed" and summary["total_steps"] == steps
    assert outcome["rc"] == 2, outcome
    # refused by the driver's run lock, before it read the resume point; it names the holder
    assert (
        f"another launch is running on this run directory (driver pid {os.getpid()}"
        in (outcome["err"])
    )
    assert outcome["steps_meanwhile"] == [1]  # refused while the first run was mid-way
    assert sorted({r.attempt for r in read_log(run_dir)}) == [1]  # the second wrote nothing
    assert sorted(committed(run_dir)) == list(range(1, steps + 1))


def test_the_worker_error_reaches_the_driver_as_itself():
    import pickle

    from sft_runtime.runtime.workers.group import PolicyWorkerError

    error = PolicyWorkerError("train_step failed: rank 1: worker died", [1])
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is PolicyWorkerError and again.ranks == [1]

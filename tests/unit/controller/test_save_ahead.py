"""A periodic checkpoint's calls go out with the step before it (`SaveAhead`), and are given
up when that step fails; with the scripted group
of test_controller_errors.py (the real one runs every save of the end-to-end and kill tests)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from sft_runtime.events import read_log
from sft_runtime.runtime.workers.group import PolicyWorkerError
from tests.unit.controller.test_controller_errors import StubGroup, _controller


class FailsAt(StubGroup):
    """Fails the ``nth`` call of ``method`` (1-based), answers every other one."""

    def __init__(self, method: str, nth: int, error: Exception) -> None:
        super().__init__()
        self.method, self.nth, self.error, self.seen = method, nth, error, 0

    def _error(self, method, args):
        if method == self.method:
            self.seen += 1
            if self.seen == self.nth:
                return self.error
        return super()._error(method, args)


def _info(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "training_info.json").read_text())


def test_a_periodic_save_goes_out_with_its_step_before_the_controller_waits(tmp_path):
    group = StubGroup()
    controller, run_dir = _controller(tmp_path, group)  # saves after step 3, then step 4
    controller.run()
    calls = group.calls
    first = calls.index("sft_dataloader_state_bytes")
    assert calls[first - 2 : first + 5] == [
        "train_sft_step",  # step 3's
        "commit_sft_batch",  # step 2's batch, by step 3's call
        "sft_dataloader_state_bytes",
        "commit_sft_batch",  # only if step 3 finished on the worker
        "begin_checkpoint",
        "checkpoint_written",
        "train_sft_step",  # step 4, behind the writes
    ]
    # the controller waited for nothing of step 3 before all of it was sent (the wait at
    # ``first`` is step 2's, before step 3's save was decided)
    assert all(sent >= first + 5 for sent, _ in group.waits if sent > first)
    assert (first, "train_sft_step") in group.waits
    records = list(read_log(run_dir))
    kinds = [(r.type, r.data["step"]) for r in records if r.type.endswith(("committed", "saved"))]
    assert kinds.index(("step_committed", 3)) < kinds.index(("checkpoint_saved", 3))
    # the checkpoint records what the step's record says, known only after the step
    info = _info(run_dir, 3)
    assert info["kinds"] == ["periodic"] and info["save_state"]["total_steps"] == 3
    info4 = _info(run_dir, 4)
    assert info4["kinds"] == ["final"]
    # step 3's own count (the same per step), not the one before it that was known at sending
    consumed = info["save_state"]["consumed_samples"], info4["save_state"]["consumed_samples"]
    assert consumed[0] > 0 and consumed[0] * 4 == consumed[1] * 3


def test_a_step_that_fails_gives_up_the_save_sent_with_it(tmp_path):
    boom = PolicyWorkerError("rank 0 fell over", [0], phase="train")
    group = FailsAt("train_sft_step", 3, boom)
    controller, run_dir = _controller(tmp_path, group)
    with pytest.raises(PolicyWorkerError, match="fell over"):
        controller.run()
    assert list((run_dir / "checkpoints").iterdir()) == []  # no step_3, no temp directory
    records = list(read_log(run_dir))
    assert [r.data["step"] for r in records if r.type == "step_committed"] == [1, 2]
    assert [r.data["step"] for r in records if r.type == "step_aborted"] == [3]
    assert not [r for r in records if r.type == "checkpoint_saved"]
    # the save's calls were waited for (their errors read) before the step was undone
    assert group.calls.index("settle") < group.calls.index("abort_train_step")


def test_a_deadline_passing_during_the_step_keeps_its_save_and_stops_after_the_next(tmp_path):
    """The deadline passes while step 3 runs, with its save and step 4 already sent: step 4
    cannot be taken back, so the save of step 3 stays periodic, step 4 is recorded, and the
    deadline's final checkpoint comes after it."""

    class DeadlineDuringStep3(StubGroup):
        def _wait(self, pending, timeout_s=None):
            if pending.method == "train_sft_step" and self.calls.count("train_sft_step") == 4:
                controller.model.rules = replace(controller.model.rules, deadline=time.time())
            return super()._wait(pending, timeout_s)

    group = DeadlineDuringStep3()
    controller, run_dir = _controller(tmp_path, group, "sft.max_num_steps=6")
    summary = controller.run()
    assert summary["reason"] == "timeout"
    records = list(read_log(run_dir))
    assert [r.data["step"] for r in records if r.type == "step_committed"] == [1, 2, 3, 4]
    assert [r.data["step"] for r in records if r.type == "checkpoint_saved"] == [3, 4]
    assert _info(run_dir, 3)["kinds"] == ["periodic"]
    assert _info(run_dir, 4)["kinds"] == ["final"]
    assert group.calls.count("begin_checkpoint") == 2  # none given up
    assert "abort_train_step" not in group.calls
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3", "step_4"]

"""Error paths of the controller loop, with a scripted stand-in for the worker group.

The real group is exercised end to end in test_end_to_end.py; here a stub lets a test make
one phase fail and check what the controller undoes, records and re-raises.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from sft_runtime.events import read_log
from sft_runtime.runtime.checkpoint.store import CheckpointDir
from sft_runtime.runtime.controller.loop import SEED_STEPS, SFTController
from sft_runtime.runtime.data.batch import StepEnvelope
from sft_runtime.runtime.data.placement import build_placement_plan
from sft_runtime.runtime.launch.setup import SFTV2ActorArgs
from sft_runtime.runtime.policy.step_outcome import StepFinished
from sft_runtime.runtime.workers.calls import Pending, WorkerCalls
from sft_runtime.runtime.workers.group import PolicyWorkerError
from sft_runtime.runtime.workers.results import StepStarted, StepTrained
from sft_runtime.states import SFTV2SaveState
from tests.support.small_run import small_config


class StubGroup(WorkerCalls):
    """Answers the controller's calls like two healthy workers, unless told to fail: the
    group's typed calls over scripted primitives."""

    owner_ranks = [0, 1]

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        self.fail = fail or {}
        self.calls: list[str] = []
        self.waits: list[tuple[int, str]] = []  # (calls sent by then, the method waited for)

    def _answer(self, method: str, rank: int):
        if method == "train_sft_step":
            envelope = StepEnvelope(rank, 2, [f"s{rank}"], ["input_ids"], [10], 0.001, 9, 1)
            started = StepStarted(envelope, begin_s=0.0, forward_backward_s=0.01, started_ns=0)
            finished = StepFinished(2.0, 1.0, 0.1, 18, 9, [], 0.01, 0.0, 0.0, step=1)
            return StepTrained(started, finished)
        if method == "sft_dataloader_state_bytes":
            return [f"state of rank {rank}".encode()]
        return None

    def _error(self, method: str, args: tuple) -> Exception | None:
        commits = (method == "train_sft_step" and args[1]) or (
            method == "sft_dataloader_state_bytes" and args[0]
        )
        if commits:  # the call commits the last recorded step's batch first
            self.calls.append("commit_sft_batch")
            if "commit_sft_batch" in self.fail:
                return self.fail["commit_sft_batch"]
        return self.fail.get(method)

    def _submit(self, method, *args, ranks="all", per_rank_args=None, **kwargs):
        self.calls.append(method)
        error = self._error(method, args)
        return Pending(method, [(r, (method, r, error)) for r in (0, 1)])

    def _wait(self, pending, timeout_s=None):
        self.waits.append((len(self.calls), pending.method))
        for _, (_, _, error) in pending.refs:
            if error is not None:
                raise error
        return [self._answer(m, r) for _, (m, r, _) in pending.refs]

    def _settle(self, pending, timeout_s):
        self.calls.append("settle")


def _controller(tmp_path: Path, group: StubGroup, *overrides: str, total_steps: int = 0):
    config = small_config(tmp_path / "run", tmp_path / "data", 4, *overrides)
    plan = build_placement_plan(
        {"data_parallel": 2, "tensor_parallel": 1, "pipeline_parallel": 1, "context_parallel": 1}
    )
    args = SFTV2ActorArgs(
        trainer=group,
        loss_fn=None,
        train_cluster={},
        placement_plan=plan,
        save_state=SFTV2SaveState(total_steps, 0, 0, plan.placement_hash),
        loader_states=None,
    )
    return SFTController(config, args), tmp_path / "run"


def _types(run_dir: Path) -> list[str]:
    return [r.type for r in read_log(run_dir, validate=True)]


def test_a_failing_train_step_is_undone_recorded_and_reraised(tmp_path):
    boom = PolicyWorkerError("rank 1 exploded", [1], phase="train")
    group = StubGroup({"train_sft_step": boom})
    controller, run_dir = _controller(tmp_path, group)
    with pytest.raises(RuntimeError) as err:
        controller.run()
    assert err.value is boom
    assert "abort_train_step" in group.calls and "abort_sft_batch" in group.calls
    # the calls already sent (the step, the next one sent ahead) are waited for first
    assert group.calls.index("settle") < group.calls.index("abort_train_step")
    records = list(read_log(run_dir))
    aborted = [r for r in records if r.type == "step_aborted"]
    assert [(a.data["step"], a.data["phase"], a.data["error"]) for a in aborted] == [
        (1, "train", "rank 1 exploded")
    ]
    assert records[-1].type == "run_stopped" and records[-1].data["reason"] == "failed"
    assert "rank 1 exploded" in records[-1].data["error"]


def test_cleanup_failures_warn_and_keep_the_original_error(tmp_path):
    boom = PolicyWorkerError("the original", [0], phase="loading")
    group = StubGroup(
        {
            "train_sft_step": boom,
            "abort_sft_batch": OSError("abort failed too"),
            "close_sft_dataloader": OSError("close failed too"),
        }
    )
    controller, run_dir = _controller(tmp_path, group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(PolicyWorkerError, match="the original"):
            controller.run()
    messages = [str(w.message) for w in caught]
    assert any("abort the loader batches" in m for m in messages)
    assert any("close the loaders" in m for m in messages)
    assert _types(run_dir)[-2:] == ["step_aborted", "run_stopped"]
    aborted = [r.data for r in read_log(run_dir) if r.type == "step_aborted"]
    assert aborted[0]["phase"] == "loading"


def test_a_loader_commit_failure_fails_the_next_step_before_it_counts(tmp_path):
    """The commit is sent without waiting; its error surfaces at the next step's first wait,
    which is aborted (nothing of it is counted) and recorded, and the run fails."""
    group = StubGroup({"commit_sft_batch": RuntimeError("commit failed")})
    controller, run_dir = _controller(tmp_path, group)
    with pytest.raises(RuntimeError, match="commit failed"):
        controller.run()
    assert "abort_train_step" in group.calls and "abort_sft_batch" in group.calls
    records = list(read_log(run_dir))
    assert [r.data["step"] for r in records if r.type == "step_committed"] == [1]
    aborted = [r.data for r in records if r.type == "step_aborted"]
    assert [(a["step"], a["phase"]) for a in aborted] == [(2, "loading")]
    assert "commit failed" in aborted[0]["error"]
    assert records[-1].type == "run_stopped" and records[-1].data["reason"] == "failed"


def test_a_save_sends_its_calls_in_order_and_waits_only_after_the_next_start(tmp_path):
    """The worker runs the loader commit and state, the checkpoint writes and the next step's
    start back to back: Ray keeps the order they were sent in, so the controller waits for
    the states only once all of them are out."""
    group = StubGroup()
    controller, run_dir = _controller(tmp_path, group)  # saves after step 3, then step 4
    controller.run()
    calls = group.calls
    first = calls.index("sft_dataloader_state_bytes")
    assert calls[first : first + 5] == [
        "sft_dataloader_state_bytes",
        "commit_sft_batch",  # by the state call, first: no start committed step 3's batch
        "begin_checkpoint",
        "checkpoint_written",
        "train_sft_step",  # step 4, behind the writes
    ]
    waited = [sent for sent, method in group.waits if method == "sft_dataloader_state_bytes"]
    assert waited[0] == first + 5  # nothing waited for between the first and the last
    assert [r.data["step"] for r in read_log(run_dir) if r.type == "checkpoint_saved"] == [3, 4]


def test_a_commit_failing_inside_a_checkpoint_leaves_no_checkpoint(tmp_path):
    """The checkpoint's own loader commit fails: the writes already sent are discarded, no
    ``step_3`` (nor its temp directory) is left, and the steps recorded stay recorded."""

    class FailTheSavesCommit(StubGroup):
        def _error(self, method, args):
            if method == "sft_dataloader_state_bytes" and args[0]:
                return RuntimeError("commit failed")
            return super()._error(method, args)

    group = FailTheSavesCommit()
    controller, run_dir = _controller(tmp_path, group)
    with pytest.raises(RuntimeError, match="commit failed"):
        controller.run()
    assert list((run_dir / "checkpoints").iterdir()) == []
    records = list(read_log(run_dir))
    assert [r.data["step"] for r in records if r.type == "step_committed"] == [1, 2, 3]
    assert not [r for r in records if r.type == "checkpoint_saved"]
    assert records[-1].type == "run_stopped" and records[-1].data["reason"] == "failed"


def test_an_unknown_checkpoint_metric_is_refused_by_the_config_listing_the_known(tmp_path):
    with pytest.raises(ValueError, match=r"checkpointing\.metric_name.*available: .*train:loss"):
        _controller(tmp_path, StubGroup(), "checkpointing.metric_name=train:accuracy")


def test_checkpoints_record_the_metric_the_way_the_reference_keys_it(tmp_path):
    controller, run_dir = _controller(tmp_path, StubGroup(), "checkpointing.metric_name=train:loss")
    assert controller._checkpoint_metric({"loss": 2.0, "lr": 0.1}) == {"train:loss": 2.0}
    controller.run()
    info = controller.ckpt.info(controller.ckpt.steps()[-1])
    assert info["train:loss"] == info["metric"] == 2.0


def test_a_run_whose_budget_is_reached_trains_nothing(tmp_path):
    group = StubGroup()
    controller, run_dir = _controller(tmp_path, group, total_steps=4)
    summary = controller.run()
    assert summary["steps_run"] == 0 and summary["reason"] == "completed"
    assert "train_sft_step" not in group.calls
    assert _types(run_dir) == ["run_started", "loaders_ready", "run_stopped"]


def test_a_stop_takes_effect_after_the_step_sent_ahead(tmp_path):
    """Step 2 goes out whole behind step 1; a stop that arrives meanwhile cannot take it back
    (its optimizer step may have run): step 2 is recorded, then the final checkpoint."""

    class StopDuringStep1(StubGroup):
        controller = None

        def _wait(self, pending, timeout_s=None):
            if pending.method == "train_sft_step" and self.calls.count("train_sft_step") == 2:
                self.controller.request_stop()
            return super()._wait(pending, timeout_s)

    group = StopDuringStep1()
    controller, run_dir = _controller(tmp_path, group, total_steps=0)
    group.controller = controller
    summary = controller.run()
    assert summary["reason"] == "interrupted" and summary["total_steps"] == 2
    calls = group.calls
    assert calls.count("train_sft_step") == 2  # step 1's, and step 2's sent ahead
    second = calls.index("train_sft_step", calls.index("train_sft_step") + 1)
    assert calls[second + 1] == "commit_sft_batch"  # step 2 commits step 1's batch first
    assert "abort_train_step" not in calls and "settle" not in calls
    records = list(read_log(run_dir))
    assert [r.data["step"] for r in records if r.type == "step_committed"] == [1, 2]
    assert [r.data["step"] for r in records if r.type == "checkpoint_saved"] == [2]


def test_the_loop_runs_the_seed_methods_with_their_seed_signatures(tmp_path):
    """An embedding user who reads or overrides a seed method reads the path that runs."""
    seen: list[tuple[str, dict]] = []

    class Watched(SFTController):
        pass

    for name in SEED_STEPS:

        def watched(self, *args, _name=name, **kwargs):
            seen.append((_name, kwargs))
            return getattr(SFTController, _name)(self, *args, **kwargs)

        setattr(Watched, name, watched)

    config = small_config(
        tmp_path / "run", tmp_path / "data", 4, "checkpointing.metric_name=train:loss"
    )
    plan = build_placement_plan(
        {"data_parallel": 2, "tensor_parallel": 1, "pipeline_parallel": 1, "context_parallel": 1}
    )
    state = SFTV2SaveState(0, 0, 0, plan.placement_hash)
    args = SFTV2ActorArgs(StubGroup(), None, {}, plan, state, None)
    Watched(config, args).run()
    assert {name for name, _ in seen} == set(SEED_STEPS)  # each runs, none beside the loop
    should_save = [kw for name, kw in seen if name == "_should_save"]
    assert len(should_save) == 4 and all(set(kw) == {"save_by_timeout"} for kw in should_save)
    saved = CheckpointDir(tmp_path / "run" / "checkpoints").steps()
    assert [n for n, _ in seen].count("_save_checkpoint") == len(saved) > 0

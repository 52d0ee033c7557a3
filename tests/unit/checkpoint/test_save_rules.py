"""The save rules, checkpoint directories and retention."""

from __future__ import annotations

import json

import pytest

from sft_runtime.runtime.checkpoint.save import state_metric
from sft_runtime.runtime.checkpoint.store import CheckpointDir
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.states import SFTV2SaveState, StepRules


def _kinds(rules: StepRules, step: int, timed_out: bool = False) -> tuple[str, ...]:
    return rules.after(SFTV2SaveState(total_steps=step), timed_out=timed_out).save_kinds


def test_save_rules_periodic_ft_and_final():
    rules = StepRules(max_steps=25, save_period=10, ft_save_period=4)
    assert _kinds(rules, 3) == ()
    assert _kinds(rules, 4) == ("ft",)
    assert _kinds(rules, 10) == ("periodic",)
    assert _kinds(rules, 20) == ("periodic", "ft")
    assert _kinds(rules, 25) == ("final",)
    due = [s for s in range(1, 26) if rules.after(SFTV2SaveState(total_steps=s)).saves]
    assert due == [4, 8, 10, 12, 16, 20, 24, 25]
    assert _kinds(rules, 3, timed_out=True) == ("final",)


def test_disabled_checkpointing_never_saves():
    rules = StepRules(max_steps=25, save_period=10, ft_save_period=4, checkpointing=False)
    assert not any(
        rules.after(SFTV2SaveState(total_steps=s), stopping=True, timed_out=True).saves
        for s in range(26)
    )


def test_metric_tagging_and_unknown_metric_lists_the_known():
    metrics = {"loss": 1.5, "grad_norm": 0.2}
    assert state_metric("train:loss", metrics) == {"train:loss": 1.5}
    assert state_metric(None, metrics) == {}
    with pytest.raises(UserInputError, match="available: train:grad_norm, train:loss"):
        state_metric("train:accuracy", metrics)


def _save(ck: CheckpointDir, step: int, kinds: list[str], metric: float | None = None) -> None:
    tmp = ck.begin(step)
    (tmp / "payload").write_text(str(step))
    ck.commit(step, tmp, {"kinds": kinds, "metric": metric})


def test_commit_renames_a_complete_directory_and_stale_tmp_is_removed(tmp_path):
    ck = CheckpointDir(tmp_path)
    _save(ck, 3, ["periodic"])
    assert ck.steps() == [3]
    assert json.loads((tmp_path / "step_3" / "training_info.json").read_text())["kinds"] == [
        "periodic"
    ]
    stale = ck.begin(6)  # a crash before the rename
    (stale / "half").write_text("x")
    assert ck.steps() == [3]
    assert ck.remove_stale() == [stale] and not stale.exists()


def test_retention_keeps_top_k_by_metric_latest_ft_and_the_newest(tmp_path):
    ck = CheckpointDir(tmp_path, save_period=10, keep_top_k=2, ft_keep_latest_k=1)
    _save(ck, 10, ["periodic"], metric=3.0)
    _save(ck, 20, ["periodic"], metric=1.0)
    _save(ck, 30, ["periodic"], metric=2.0)
    _save(ck, 34, ["ft"])
    _save(ck, 38, ["ft"])
    _save(ck, 40, ["periodic"], metric=5.0)
    _save(ck, 44, ["ft"])
    removed = ck.prune()
    # periodic = divisible by 10; best two by lower loss: 20 (1.0), 30 (2.0); latest of all: 44
    assert ck.steps() == [20, 30, 44]
    assert sorted(removed) == [10, 34, 38, 40]


def test_retention_higher_is_better_and_without_limits(tmp_path):
    ck = CheckpointDir(tmp_path, save_period=1, keep_top_k=1, higher_is_better=True)
    for step, metric in ((1, 0.1), (2, 0.9), (3, 0.5)):
        _save(ck, step, ["periodic"], metric=metric)
    ck.prune()
    assert ck.steps() == [2, 3]
    keep_all = CheckpointDir(tmp_path / "all")
    for step in (1, 2, 3):
        _save(keep_all, step, ["periodic"])
    keep_all.prune()
    assert keep_all.steps() == [1, 2, 3]

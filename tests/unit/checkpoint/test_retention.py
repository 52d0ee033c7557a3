"""Checkpoint retention follows the NeMo RL reference: periodicity from the step number,
null limits meaning "no limit", and nothing pruned when both limits are null."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sft_runtime.runtime.checkpoint.store import INFO_NAME, CheckpointDir, retained_steps
from sft_runtime.runtime.config import CheckpointingConfig, run_checkpoints, validate_config
from sft_runtime.runtime.config_files.overrides import apply_override
from tests.support.small_run import small_raw

# id, steps, metrics, save_period, keep_top_k, ft_keep_latest_k, higher_is_better, kept
CASES = [
    ("no_checkpoints", [], None, 10, 2, 1, False, set()),
    (
        "both_null_keeps_all",
        [3, 10, 13, 20, 27],
        {10: 5.0, 20: 1.0},
        10,
        None,
        None,
        False,
        {3, 10, 13, 20, 27},
    ),
    (
        "newest_kept_though_off_period_and_worst",
        [10, 20, 25],
        {10: 1.0, 20: 2.0, 25: 99.0},
        10,
        1,
        None,
        False,
        {10, 25},
    ),
    (
        "off_period_final_saves_pruned",
        [10, 13, 20, 27, 30, 35],
        None,
        10,
        2,
        None,
        False,
        {20, 30, 35},
    ),
    (
        "top_k_null_keeps_every_periodic",
        [10, 13, 20, 27, 30, 35],
        None,
        10,
        None,
        1,
        False,
        {10, 20, 30, 35},
    ),
    (
        "best_by_lower_metric",
        [10, 20, 30, 40, 41],
        {10: 3.0, 20: 1.0, 30: 2.0, 40: 5.0, 41: 0.0},
        10,
        2,
        None,
        False,
        {20, 30, 41},
    ),
    (
        "best_by_higher_metric",
        [10, 20, 30, 40, 41],
        {10: 0.1, 20: 0.9, 30: 0.5, 40: 0.2, 41: 0.0},
        10,
        2,
        None,
        True,
        {20, 30, 41},
    ),
    (
        "ties_keep_the_newer",
        [10, 20, 30, 31],
        {10: 1.0, 20: 1.0, 30: 5.0},
        10,
        1,
        None,
        False,
        {20, 31},
    ),
    (
        "ties_keep_the_newer_higher",
        [10, 20, 30, 31],
        {10: 5.0, 20: 5.0, 30: 1.0},
        10,
        1,
        None,
        True,
        {20, 31},
    ),
    (
        "missing_metric_worst_lower_is_better",
        [10, 20, 30, 31],
        {10: None, 20: 5.0, 30: 9.0},
        10,
        1,
        None,
        False,
        {20, 31},
    ),
    (
        "missing_metric_worst_higher_is_better",
        [10, 20, 30, 31],
        {10: 1.0, 30: 0.5},  # 20 has no entry at all
        10,
        1,
        None,
        True,
        {10, 31},
    ),
    (
        "missing_metrics_rank_by_recency_among_themselves",
        [10, 20, 30, 40, 41],
        {10: 7.0},
        10,
        3,
        None,
        False,
        {10, 30, 40, 41},
    ),
    ("recency_without_metric", [10, 20, 30, 40, 41], None, 10, 2, None, False, {30, 40, 41}),
    (
        "ft_keep_latest_k_counts_all_checkpoints",
        [10, 13, 20, 27],
        {10: 0.1, 20: 0.9},
        10,
        1,
        2,
        False,
        {10, 20, 27},
    ),
    (
        "ft_keep_latest_k_larger_than_periodic_gap",
        [10, 13, 20, 27],
        {10: 0.1, 20: 0.9},
        10,
        1,
        3,
        False,
        {10, 13, 20, 27},
    ),
    (
        "ft_only_with_top_k_null_keeps_periodic_and_latest",
        [10, 13, 20, 24, 27],
        None,
        10,
        None,
        1,
        False,
        {10, 20, 27},
    ),
    ("save_period_zero_means_no_periodic", [5, 10, 15], {5: 0.1}, 0, 2, None, False, {15}),
    ("save_period_zero_with_ft", [1, 2, 3, 4], None, 0, None, 2, False, {3, 4}),
    ("unsorted_input", [30, 10, 20], None, 10, 1, None, False, {30}),
]


@pytest.mark.parametrize(
    ("steps", "metrics", "save_period", "keep_top_k", "ft_keep_latest_k", "higher", "kept"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_retained_steps(steps, metrics, save_period, keep_top_k, ft_keep_latest_k, higher, kept):
    assert retained_steps(steps, metrics, save_period, keep_top_k, ft_keep_latest_k, higher) == kept


def test_default_config_keeps_nemo_rls_three():
    """NeMo RL's ``keep_top_k: 3``: the three best by the metric (lower is better) and the
    latest (a resume starts there), or with no metric the three latest; null keeps all."""
    ck = CheckpointingConfig()
    assert ck.keep_top_k == 3 and ck.ft_keep_latest_k is None and not ck.higher_is_better
    steps = [10, 20, 30, 40, 50]
    rules = (ck.save_period, ck.keep_top_k, ck.ft_keep_latest_k, ck.higher_is_better)
    losses = {10: 0.5, 20: 0.2, 30: 0.4, 40: 0.3, 50: 0.6}
    assert retained_steps(steps, losses, *rules) == {20, 30, 40, 50}
    assert retained_steps(steps, {}, *rules) == {30, 40, 50}
    everything = CheckpointingConfig(keep_top_k=None)
    assert retained_steps(
        steps, losses, everything.save_period, None, None, everything.higher_is_better
    ) == set(steps)


def _write(root: Path, step: int, info: dict | str) -> None:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "payload").write_text(str(step))
    (d / INFO_NAME).write_text(info if isinstance(info, str) else json.dumps(info))


def test_prune_on_disk_by_step_number_not_kinds(tmp_path):
    # 13 is a stop's save with the best metric and 'periodic' among its kinds: still not
    # periodic, because 13 % 10 != 0. 30's info is unreadable and ranks worst; the newest
    # (45) has an unreadable info too and is kept regardless.
    _write(tmp_path, 10, {"kinds": ["periodic"], "metric": 3.0})
    _write(tmp_path, 13, {"kinds": ["periodic", "final"], "metric": 0.1})
    _write(tmp_path, 20, {"kinds": ["periodic"], "metric": 1.0})
    _write(tmp_path, 30, "{not json")
    _write(tmp_path, 40, {"kinds": ["periodic"], "metric": None})
    _write(tmp_path, 45, "")
    (tmp_path / "tmp_step_50").mkdir()  # work in progress is not a checkpoint
    ck = CheckpointDir(tmp_path, save_period=10, keep_top_k=2)
    removed = ck.prune()
    assert sorted(removed) == [13, 30, 40]
    assert ck.steps() == [10, 20, 45]
    assert (tmp_path / "tmp_step_50").is_dir()
    assert ck.prune() == []  # idempotent


def test_prune_with_both_null_removes_nothing(tmp_path):
    for step in (10, 13, 20):
        _write(tmp_path, step, {"metric": float(step)})
    ck = CheckpointDir(tmp_path, save_period=10)
    assert ck.prune() == []
    assert ck.steps() == [10, 13, 20]


def test_run_checkpoints_passes_save_period(tmp_path):
    raw = small_raw(tmp_path / "run", tmp_path / "data")
    for override in (
        f"checkpointing.checkpoint_dir={tmp_path / 'ck'}",
        "checkpointing.save_period=4",
        "checkpointing.keep_top_k=1",
    ):
        apply_override(raw, override)
    ck = run_checkpoints(validate_config(raw))
    assert (ck.save_period, ck.keep_top_k, ck.ft_keep_latest_k) == (4, 1, None)
    for step, metric in ((4, 2.0), (6, 0.5), (8, 1.0), (9, 9.0)):
        _write(ck.root, step, {"metric": metric})
    assert ck.prune() == [4, 6]
    assert ck.steps() == [8, 9]

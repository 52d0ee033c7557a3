"""A resume never silently changes what the steps compute.

Each case resumes a copy of the reference run rewound to checkpoint 3 (what a crash right
after that save leaves) with `sft-runtime train` in-process on the session's Ray. A changed
key that decides the computation is refused before Ray with one line naming it (old -> new),
unless `--allow-config-change` says to train on, and then `run_started` records it. A data
set is judged by its content, not its path; a changed model shape is refused whatever the
flag says; a checkpoint without optimizer state says that AdamW starts fresh.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sft_runtime.events import read_log
from sft_runtime.events.log import open_log
from sft_runtime.events.schemas import RunStarted, RunStopped
from tests.support.reliability import (
    compare,
    dir_digest,
    rewind_copy,
    train,
    verify,
)

ALLOW = "--allow-config-change"


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the run gets as far as starting or joining Ray."""
    from sft_runtime.runtime.launch import setup

    def refuse(*_a, **_k):
        raise AssertionError("Ray was reached: the refusal must come before it")

    monkeypatch.setattr(setup, "ensure_ray", refuse)


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("sft-runtime train: error:")]


def _run_started(run_dir: Path) -> list[dict]:
    return [r.data for r in read_log(run_dir) if r.type == "run_started"]


def _refused(run_dir: Path, data: Path, capsys, *overrides: str) -> str:
    before = dir_digest(run_dir)
    rc, out = train(run_dir, data, capsys, *overrides)
    assert rc == 2, out
    assert dir_digest(run_dir) == before, "a refused resume changed saved files"
    assert "Traceback" not in out
    lines = _error_lines(out)
    assert len(lines) == 1, out
    return lines[0]


def test_a_changed_micro_batch_is_refused_before_ray_naming_the_key(
    reference, demo_data, tmp_path, capsys, no_ray
):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    line = _refused(run_dir, demo_data, capsys, "policy.train_micro_batch_size=4")
    assert "policy.train_micro_batch_size: 2 -> 4" in line
    assert ALLOW in line
    assert "step_3" in line  # which checkpoint it was compared with


def test_an_allowed_change_trains_and_is_recorded(reference, demo_data, tmp_path, capsys):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    rc, out = train(run_dir, demo_data, capsys, "policy.train_micro_batch_size=4", ALLOW)
    assert rc == 0, out
    assert "resumed from step 3" in out
    assert "policy.train_micro_batch_size: 2 -> 4" in out  # said when it starts
    first, resumed = _run_started(run_dir)
    assert resumed["resumed_from_step"] == 3
    assert resumed["config_changes"] == {"policy.train_micro_batch_size": [2, 4]}
    assert resumed["config_digest"].startswith("sha256:")
    assert first["config_digest"].startswith("sha256:")
    assert resumed["config_digest"] != first["config_digest"]
    assert resumed["optimizer_restored"] is True
    # the new checkpoints hold the new value: the same command resumes them unchanged
    rc, out = train(run_dir, demo_data, capsys, "policy.train_micro_batch_size=4")
    assert rc == 0, out
    rc, shown = _events(run_dir, capsys)
    assert rc == 0, shown
    assert "policy.train_micro_batch_size: 2 -> 4" in shown


def test_steps_re_executed_under_an_allowed_change_are_not_called_divergent(
    reference, demo_data, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    for step in (6, 7):  # lost: the resume goes back to 3 and runs 4-7 again
        shutil.rmtree(run_dir / "checkpoints" / f"step_{step}")
    rc, out = train(run_dir, demo_data, capsys, "policy.train_micro_batch_size=4", ALLOW)
    assert rc == 0, out
    assert "resumed from step 3" in out
    rc, vout = verify(run_dir)
    assert rc == 0, vout
    assert "re-executed steps compared: 0, divergent: 0" in vout
    assert "policy.train_micro_batch_size: 2 -> 4" in vout  # why they were not compared


def _events(run_dir: Path, capsys) -> tuple[int, str]:
    from sft_runtime.runtime.cli.main import main as cli_main

    capsys.readouterr()
    rc = cli_main(["events", str(run_dir)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_config_digest_is_recorded_and_unchanged_by_free_keys(
    reference, demo_data, tmp_path, capsys
):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    # a longer budget, another save period and no read-ahead change what runs, not a step
    rc, out = train(
        run_dir, demo_data, capsys, "sft.max_num_steps=8", "checkpointing.save_period=4"
    )
    assert rc == 0, out
    first, resumed = _run_started(run_dir)
    assert resumed["config_changes"] == {}
    assert resumed["config_digest"] == first["config_digest"]
    assert all(r["config_digest"] for r in (first, resumed))


@pytest.mark.parametrize("flag", [(), (ALLOW,)], ids=["plain", "allowed"])
def test_a_changed_model_shape_is_refused_before_ray(
    reference, demo_data, tmp_path, capsys, no_ray, flag
):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    line = _refused(run_dir, demo_data, capsys, "policy.model.d_model=64", *flag)
    assert "policy.model.d_model: 32 -> 64" in line
    assert "cannot" in line  # the weights do not fit: no flag makes them


def test_a_data_set_moved_to_another_path_resumes_exactly(reference, demo_data, tmp_path, capsys):
    moved = tmp_path / "elsewhere" / "chats"
    shutil.copytree(demo_data, moved)
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    rc, out = train(run_dir, moved, capsys)
    assert rc == 0, out
    assert "resumed from step 3" in out
    assert _run_started(run_dir)[-1]["config_changes"] == {}
    cmp = compare(run_dir, reference)  # losses, samples, final weights, and verify
    assert cmp.mismatches == []


def test_a_data_set_with_other_content_is_refused(reference, demo_data, tmp_path, capsys, no_ray):
    from sft_runtime.runtime.data.demo import build_demo_dataset

    other = build_demo_dataset(tmp_path / "other", num_samples=256, seed=1)
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    line = _refused(run_dir, other, capsys)
    assert "data.train.path" in line and str(other) in line and ALLOW in line


def test_after_a_divergence_a_smaller_lr_resumes_without_the_flag(
    reference, demo_data, tmp_path, capsys
):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    placement = _run_started(run_dir)[0]["placement_hash"]
    with open_log(run_dir) as log:  # an attempt that resumed from 3 and diverged at once
        log.append(RunStarted(placement_hash=placement, resumed_from_step=3, max_steps=7))
        log.append(RunStopped(reason="diverged", last_step=3, error="step 4 diverged"))
    rc, out = train(run_dir, demo_data, capsys, "policy.optimizer.kwargs.lr=0.001")
    assert rc == 0, out
    changes = _run_started(run_dir)[-1]["config_changes"]
    assert changes == {"policy.optimizer.kwargs.lr": [0.003, 0.001]}
    # other keys still need the flag after a divergence
    run_dir = rewind_copy(reference, tmp_path / "run2", 3)
    with open_log(run_dir) as log:
        log.append(RunStarted(placement_hash=placement, resumed_from_step=3, max_steps=7))
        log.append(RunStopped(reason="diverged", last_step=3, error="step 4 diverged"))
    before = dir_digest(run_dir)
    rc, out = train(run_dir, demo_data, capsys, "policy.train_micro_batch_size=4")
    assert rc == 2 and "policy.train_micro_batch_size: 2 -> 4" in out, out
    assert dir_digest(run_dir) == before


def test_without_the_divergence_an_lr_change_needs_the_flag(
    reference, demo_data, tmp_path, capsys, no_ray
):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    line = _refused(run_dir, demo_data, capsys, "policy.optimizer.kwargs.lr=0.001")
    assert "policy.optimizer.kwargs.lr: 0.003 -> 0.001" in line


def test_a_resume_without_optimizer_state_says_adamw_starts_fresh(demo_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    no_optimizer = "checkpointing.save_optimizer=false"
    rc, out = train(run_dir, demo_data, capsys, "sft.max_num_steps=3", no_optimizer)
    assert rc == 0, out
    assert not (run_dir / "checkpoints" / "step_3" / "policy" / "optimizer").exists()
    rc, out = train(run_dir, demo_data, capsys, "sft.max_num_steps=4", no_optimizer)
    assert rc == 0, out
    assert "AdamW starts fresh" in out
    first, resumed = _run_started(run_dir)
    assert first["optimizer_restored"] is None  # a fresh start restores nothing
    assert resumed["optimizer_restored"] is False
    assert resumed["config_digest"] == first["config_digest"]
    rc, shown = _events(run_dir, capsys)
    assert "AdamW started fresh" in shown, shown
    rc, vout = verify(run_dir)
    assert rc == 0, vout


def test_a_thread_count_change_is_refused_before_ray_and_allowed_with_the_flag(
    reference, demo_data, tmp_path, capsys, monkeypatch
):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    threads = "cluster.num_threads_per_worker=2"
    with monkeypatch.context() as patch:  # refused before Ray, as every other such key
        from sft_runtime.runtime.launch import setup

        patch.setattr(setup, "ensure_ray", lambda *_a, **_k: pytest.fail("Ray was reached"))
        line = _refused(run_dir, demo_data, capsys, threads)
    assert "cluster.num_threads_per_worker: 1 -> 2" in line
    rc, out = train(run_dir, demo_data, capsys, threads, ALLOW)  # the workers accept it too
    assert rc == 0, out
    assert _run_started(run_dir)[-1]["config_changes"] == {"cluster.num_threads_per_worker": [1, 2]}

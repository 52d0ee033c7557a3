"""The tools find what the run wrote: they follow the log's ``checkpoint_saved`` records.

A run whose ``checkpointing.checkpoint_dir`` lies outside the run directory (as every NeMo
RL config has it) is summarised, verified, exported, sampled and diffed without any
``--checkpoint-dir``; a recorded checkpoint that is gone fails `verify` naming it, one the
retention rules pruned does not; a run directory moved elsewhere is followed to its own
checkpoints, not to where it was written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.launch.driver import run_training
from tests.support.fixtures import HF_STEPS, hf_overrides
from tests.support.logbuild import Attempt, write_checkpoint, write_run
from tests.support.small_run import small_config, small_raw

SAVED = [2, 4, 5]  # save_period 2 of `hf_overrides`, and the end


def _cli(*args: str) -> tuple[int, str, str]:
    """`sft-runtime ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def outside_runs(ray_session, demo_data, tiny_llama, tmp_path_factory) -> dict:
    """Two identical Hugging Face runs, each saving into a folder beside its run directory:
    run A through the `train` command (its output kept), run B through `run_training`."""
    root = tmp_path_factory.mktemp("outside")
    runs: dict = {}
    for name in ("a", "b"):
        run_dir, ckpt = root / f"run_{name}", root / f"ckpt_{name}"
        overrides = (*hf_overrides(tiny_llama), f"checkpointing.checkpoint_dir={ckpt}")
        runs[name], runs[f"ckpt_{name}"] = run_dir, ckpt
        if name == "b":
            summary = run_training(small_config(run_dir, demo_data, HF_STEPS, *overrides))
            assert summary["reason"] == "completed"
            continue
        config = root / "a.yaml"
        config.write_text(yaml.safe_dump(small_raw(run_dir, demo_data, HF_STEPS)))
        rc, out, err = _cli("train", str(config), *overrides, "--run-dir", str(run_dir))
        assert rc == 0, out + err
        runs["train_output"] = out
    return runs


def test_the_summary_line_names_the_folder_the_checkpoints_are_in(outside_runs):
    out, ckpt = outside_runs["train_output"], outside_runs["ckpt_a"]
    words = " ".join(out.split())  # however the console wrapped it
    assert f"checkpoints: {SAVED} under {ckpt} " in words + " ", out
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step_{s}" for s in SAVED]
    assert not (outside_runs["a"] / "checkpoints").exists()


def test_verify_checks_the_checkpoints_the_log_records(outside_runs):
    rc, out, err = _cli("verify", str(outside_runs["a"]))
    assert rc == 0, out + err
    assert f"checkpoints agree: {SAVED}" in out


def test_export_and_samples_need_no_checkpoint_dir(outside_runs, tmp_path):
    run = str(outside_runs["a"])
    rc, out, err = _cli("export", run, str(tmp_path / "model"))
    assert rc == 0, err
    assert (tmp_path / "model" / "config.json").is_file()
    assert f"exported step_{SAVED[-1]}" in err
    rc, out, err = _cli("samples", run, "--step", "3", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [row["checkpoint"] for row in rows] == [2, 2] and all(r["samples"] for r in rows)


def test_diff_reads_each_runs_config_from_its_recorded_checkpoints(outside_runs):
    rc, out, err = _cli("diff", str(outside_runs["a"]), str(outside_runs["b"]))
    assert rc == 0, out + err  # the same run twice: identical step for step
    assert "config differences:" in out and "checkpointing.checkpoint_dir" in out, out
    assert "not compared" not in out


def test_a_missing_recorded_checkpoint_fails_verify_naming_it(outside_runs, tmp_path):
    gone = outside_runs["ckpt_a"] / "step_4"
    os.rename(gone, tmp_path / "step_4")  # put back after: the other tests read the run
    try:
        rc, out, err = _cli("verify", str(outside_runs["a"]))
    finally:
        os.rename(tmp_path / "step_4", gone)
    assert rc == 1, out + err
    assert str(gone) in err and "missing" in err, err


def test_a_moved_run_directory_is_followed_to_its_own_checkpoints(reference, tmp_path):
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(reference.run_dir, moved)  # the original stays: it must not be read
    rc, out, err = _cli("verify", str(moved))
    assert rc == 0 and "checkpoints agree: [3, 6, 7]" in out, out + err
    shutil.rmtree(moved / "checkpoints" / "step_3")
    rc, out, err = _cli("verify", str(moved))
    assert rc == 1 and str(moved / "checkpoints" / "step_3") in err, out + err
    assert (reference.run_dir / "checkpoints" / "step_3").is_dir()


# ----------------------------------------------------------------------------- retention
def _saved_every_step(run_dir: Path, on_disk: list[int], checkpointing: dict) -> None:
    """A log that saved steps 1..6, with only ``on_disk`` left, each made by a run whose
    ``checkpointing`` section is given."""
    write_run(run_dir, [Attempt(until=6, save_every=1)])
    for step in on_disk:
        folder = write_checkpoint(run_dir, step)
        (folder / "config.yaml").write_text(yaml.safe_dump({"checkpointing": checkpointing}))


def test_checkpoints_the_retention_rules_pruned_are_not_missing(tmp_path):
    run_dir = tmp_path / "run"
    _saved_every_step(run_dir, [5, 6], {"save_period": 1, "keep_top_k": 2})
    rc, out, err = _cli("verify", str(run_dir))
    assert rc == 0, out + err
    assert "checkpoints agree: [5, 6]" in out and "pruned by retention: [1, 2, 3, 4]" in out


def test_without_retention_rules_every_recorded_checkpoint_must_be_there(tmp_path):
    run_dir = tmp_path / "run"
    _saved_every_step(run_dir, [5, 6], {"save_period": 1, "keep_top_k": None})  # keeps all
    rc, out, err = _cli("verify", str(run_dir))
    assert rc == 1, out + err
    for step in (1, 2, 3, 4):
        assert str(run_dir / "checkpoints" / f"step_{step}") in err
    # a checkpoint the rules keep (the two best; no metric: the two newest) is missing
    run_dir = tmp_path / "kept"
    _saved_every_step(run_dir, [6], {"save_period": 1, "keep_top_k": 2})
    rc, out, err = _cli("verify", str(run_dir))
    assert rc == 1 and str(run_dir / "checkpoints" / "step_5") in err, out + err
    assert "step_4" not in err


def test_a_checkpoint_dir_that_does_not_exist_is_bad_input(tmp_path):
    run_dir = tmp_path / "run"
    _saved_every_step(run_dir, [6], {"save_period": 1})
    rc, out, err = _cli("verify", str(run_dir), "--checkpoint-dir", str(tmp_path / "nope"))
    assert rc == 2 and err.count("\n") == 1, out + err
    assert f"--checkpoint-dir {tmp_path / 'nope'}: no such folder" in err
    rc, out, err = _cli("verify", str(run_dir), "--checkpoint-dir", str(run_dir / "checkpoints"))
    assert rc == 1 and "step_5" in err  # the same rules, under the folder given

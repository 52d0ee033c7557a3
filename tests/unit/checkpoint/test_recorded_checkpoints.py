"""Where the tools look for a run's checkpoints, how verify reads a growing log, and what a
resume leaves of metrics.jsonl: the rules, on written files (no Ray, no torch)."""

from __future__ import annotations

import os
from pathlib import Path

from sft_runtime.events import read_log
from sft_runtime.events.snapshot import LogSnapshot
from sft_runtime.runtime.checkpoint.recorded import (
    checkpoint_folder,
    checkpoint_store,
    record_path,
    recorded_checkpoints,
)
from sft_runtime.runtime.metrics.metrics_log import read_metrics
from sft_runtime.runtime.metrics.superseded import drop_superseded_rows
from sft_runtime.states import replay
from tests.support.logbuild import Attempt, write_run


def test_a_folder_inside_the_run_is_recorded_relative_to_it_any_other_absolute(tmp_path):
    run = tmp_path / "run"
    assert record_path(run / "checkpoints" / "step_3", run) == Path("checkpoints/step_3")
    assert record_path(tmp_path / "ck" / "step_3", run) == tmp_path / "ck" / "step_3"
    old = os.getcwd()
    os.chdir(tmp_path)
    try:  # a run launched with a relative --run-dir
        assert record_path("run/ckpt/step_3", "run") == Path("ckpt/step_3")
    finally:
        os.chdir(old)


def test_a_recorded_folder_is_looked_for_under_the_run_directory_first(tmp_path):
    moved = tmp_path / "moved"
    (moved / "checkpoints" / "step_3").mkdir(parents=True)
    (moved / "mine" / "step_3").mkdir(parents=True)
    original = tmp_path / "original" / "checkpoints" / "step_3"
    original.mkdir(parents=True)  # still there: a copy must not be read through to it
    assert checkpoint_folder("mine/step_3", 3, moved) == moved / "mine" / "step_3"
    assert checkpoint_folder(str(original), 3, moved) == moved / "checkpoints" / "step_3"
    outside = tmp_path / "outside" / "step_3"
    outside.mkdir(parents=True)
    assert checkpoint_folder(str(outside), 3, tmp_path / "elsewhere") == outside
    # the default layout of an older log, launched with a relative run directory
    legacy = checkpoint_folder("runs/x/checkpoints/step_3", 3, moved)
    assert legacy == moved / "checkpoints" / "step_3"
    # nowhere: where the log says; a --checkpoint-dir overrides everything
    assert checkpoint_folder("gone/step_3", 3, moved) == moved / "gone" / "step_3"
    assert checkpoint_folder(str(outside), 3, moved, tmp_path / "x") == tmp_path / "x" / "step_3"


def test_the_store_is_the_folder_of_the_newest_recorded_checkpoint(tmp_path):
    run = tmp_path / "run"
    write_run(run, [Attempt(until=6, save_every=3)])
    assert [c.step for c in recorded_checkpoints(read_log(run), run)] == [3, 6]
    assert checkpoint_store(run).root == run / "checkpoints"  # none on disk: where recorded
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    assert [c.exists for c in recorded_checkpoints(read_log(run), run)] == [True, False]
    assert checkpoint_store(tmp_path / "no-log").root == tmp_path / "no-log" / "checkpoints"


def test_a_snapshot_reads_the_same_lines_however_the_log_grows(tmp_path):
    write_run(tmp_path, [Attempt(until=3, save_every=3, stop=None)])
    snapshot = LogSnapshot(tmp_path, validate=True)
    first = [r.seq for r in snapshot]
    # a later attempt resumes from 3 and commits 4-5: a snapshot taken before
    # must neither see its records nor let its run_started roll back the ones it holds
    write_run(tmp_path, [Attempt(until=5, resume=3)])
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.write(b'{"seq": 99')  # a line being written
    assert [r.seq for r in snapshot] == first and snapshot.torn_bytes == 0
    assert snapshot.resume_points() == [(1, 0)]
    assert replay(snapshot).total_steps == 3
    assert replay(LogSnapshot(tmp_path)).total_steps == 5


def test_a_resume_keeps_the_rows_up_to_its_step_and_drops_the_rest(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert drop_superseded_rows(tmp_path, 3) == 0 and not path.exists()
    rows = [b'{"step":0,"val":{"val_loss":2.0}}']
    rows += [b'{"step":%d,"train":{"loss":%d}}' % (s, s) for s in range(1, 6)]
    path.write_bytes(b"\n".join(rows) + b"\n" + b'{"step":6,"tr')  # torn by the kill
    assert drop_superseded_rows(tmp_path, 3) == 3
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    assert path.read_bytes().endswith(b"\n")
    inode = path.stat().st_ino
    assert drop_superseded_rows(tmp_path, 3) == 0 and path.stat().st_ino == inode  # untouched
    assert drop_superseded_rows(tmp_path, 0) == 3  # a fresh start keeps the step-0 pass
    assert [r["step"] for r in read_metrics(path)] == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no tmp left

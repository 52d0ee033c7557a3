"""run_started's config record in the lineage: shown per attempt, and re-executed steps of
attempts that computed with another config (or a fresh AdamW) are not compared."""

from __future__ import annotations

from pathlib import Path

from sft_runtime.events import compare_reexecutions, history, read_log
from sft_runtime.events.log import open_log
from sft_runtime.events.schemas import RunStarted, RunStopped
from sft_runtime.runtime.cli.inspect import config_notes
from tests.support.logbuild import PLACEMENT, step_event


def _attempt(run_dir: Path, first: int, last: int, *, resume: int | None, salt: str, **kw):
    with open_log(run_dir, fsync=False) as log:
        log.append(RunStarted(placement_hash=PLACEMENT, resumed_from_step=resume, **kw))
        for step in range(first, last + 1):
            log.append(step_event(step, salt=salt))
        log.append(RunStopped(reason="failed", last_step=last))


def test_steps_of_another_config_are_not_compared(tmp_path):
    _attempt(tmp_path, 1, 4, resume=None, salt="", config_digest="sha256:a")
    changed = {"policy.optimizer.kwargs.lr": [0.003, 0.001]}
    _attempt(tmp_path, 3, 4, resume=2, salt="x", config_digest="sha256:b", config_changes=changed)
    assert compare_reexecutions(tmp_path) == (0, [])  # steps 3, 4 ran under another lr
    att = history(read_log(tmp_path)).attempts[1]
    assert att.config_changes == changed and att.config_digest == "sha256:b"
    (note,) = config_notes(att)
    assert "policy.optimizer.kwargs.lr: 0.003 -> 0.001" in note and "resumed from step 2" in note


def test_steps_of_the_same_config_are_still_compared(tmp_path):
    _attempt(tmp_path, 1, 4, resume=None, salt="", config_digest="sha256:a")
    _attempt(tmp_path, 3, 4, resume=2, salt="x", config_digest="sha256:a", config_changes={})
    compared, found = compare_reexecutions(tmp_path)
    assert compared == 2 and [d.step for d in found] == [3, 4]


def test_a_fresh_optimizer_is_not_compared_and_is_said(tmp_path):
    _attempt(tmp_path, 1, 4, resume=None, salt="", config_digest="sha256:a")
    _attempt(
        tmp_path,
        3,
        4,
        resume=2,
        salt="x",
        config_digest="sha256:a",
        config_changes={},
        optimizer_restored=False,
    )
    assert compare_reexecutions(tmp_path) == (0, [])
    (note,) = config_notes(history(read_log(tmp_path)).attempts[1])
    assert "AdamW started fresh" in note


def test_logs_without_digests_compare_as_before(tmp_path):
    _attempt(tmp_path, 1, 4, resume=None, salt="")
    _attempt(tmp_path, 3, 4, resume=2, salt="x")
    compared, found = compare_reexecutions(tmp_path)
    assert compared == 2 and len(found) == 2

"""Lineage: resumes discard rolled-back steps; history; divergence of re-executed steps."""

from __future__ import annotations

import pytest

from sft_runtime.events import LineageError, compare_reexecutions, divergence, history, read_log
from sft_runtime.events.lineage import records_in_effect
from sft_runtime.states import replay
from tests.support.logbuild import Attempt, totals_at, write_run


def _steps_in_effect(run_dir):
    return [
        (r.attempt, r.data["step"])
        for r in records_in_effect(read_log(run_dir))
        if r.type == "step_committed"
    ]


def test_resume_from_k_discards_the_older_attempts_steps_after_k(tmp_path):
    write_run(
        tmp_path,
        [Attempt(until=7, save_every=3, stop=None), Attempt(until=9, resume=6)],
    )
    assert _steps_in_effect(tmp_path) == [(1, s) for s in range(1, 7)] + [(2, 7), (2, 8), (2, 9)]
    state = replay(tmp_path)
    assert (state.total_steps, state.consumed_samples, state.total_valid_tokens) == tuple(
        totals_at(9)
    )


def test_nested_resumes_follow_the_latest_lineage(tmp_path):
    write_run(
        tmp_path,
        [
            Attempt(until=10, save_every=2, stop=None),  # 1..10, checkpoints 2,4,..,10
            Attempt(until=12, resume=8, stop=None),  # rolls back 9,10; reruns 9..12
            Attempt(until=7, resume=4, stop="interrupted"),  # rolls back everything after 4
            Attempt(until=9, resume=4),
        ],
    )
    effect = _steps_in_effect(tmp_path)
    assert [s for _, s in effect] == list(range(1, 10))
    assert effect[:4] == [(1, 1), (1, 2), (1, 3), (1, 4)]
    assert effect[4:] == [(4, 5), (4, 6), (4, 7), (4, 8), (4, 9)]
    assert replay(tmp_path).total_steps == 9
    compared, found = compare_reexecutions(read_log(tmp_path))
    # each rerun is compared with the first execution of its step:
    # attempt 2 reruns 9, 10; attempt 3 reruns 5..7; attempt 4 reruns 5..9
    assert compared == 2 + 3 + 5 and found == []


def test_replay_can_stop_at_any_step(tmp_path):
    write_run(tmp_path, [Attempt(until=6, save_every=3, stop=None), Attempt(until=8, resume=3)])
    for step in range(0, 9):
        state = replay(tmp_path, until_step=step)
        assert (state.total_steps, state.consumed_samples, state.total_valid_tokens) == tuple(
            totals_at(step)
        )
    with pytest.raises(ValueError, match="ends at step 8"):
        replay(tmp_path, until_step=9)


def test_history_tells_attempts_steps_aborts_checkpoints_and_endings(tmp_path):
    write_run(
        tmp_path,
        [
            Attempt(until=5, save_every=2, stop=None, abort_at=3),
            Attempt(until=6, resume=4, stop="completed"),
        ],
    )
    hist = history(read_log(tmp_path))
    first, second = hist.attempts
    assert (first.number, first.resumed_from_step, first.first_step, first.last_step) == (
        1,
        None,
        1,
        5,
    )
    assert first.steps == 5 and first.rolled_back == 1 and first.checkpoints == [2, 4]
    assert [a["step"] for a in first.aborts] == [3]
    assert first.stop_reason is None and "crashed" in first.outcome
    assert (second.resumed_from_step, second.first_step, second.last_step) == (4, 5, 6)
    assert second.outcome == "completed" and second.rolled_back == 0


def test_divergence_finds_a_planted_sample_difference_at_the_right_step(tmp_path):
    write_run(
        tmp_path,
        [Attempt(until=8, save_every=4, stop=None), Attempt(until=8, resume=4, salt="other")],
    )
    found = divergence(read_log(tmp_path))
    assert found is not None and found.step == 5 and found.field == "sample_digests"
    assert found.ranks == (0, 1) and (found.first_attempt, found.later_attempt) == (1, 2)
    assert "step 5" in found.describe()


def test_divergence_finds_a_loss_difference(tmp_path):
    write_run(
        tmp_path,
        [Attempt(until=8, save_every=4, stop=None), Attempt(until=8, resume=4, loss_bump=7)],
    )
    found = divergence(read_log(tmp_path))
    assert found is not None and (found.step, found.field) == (7, "loss")


def test_exact_rerun_has_no_divergence(tmp_path):
    write_run(tmp_path, [Attempt(until=8, save_every=4, stop=None), Attempt(until=8, resume=4)])
    assert divergence(read_log(tmp_path)) is None
    assert compare_reexecutions(read_log(tmp_path))[0] == 4


def test_resume_from_a_step_without_checkpoint_is_refused(tmp_path):
    write_run(tmp_path, [Attempt(until=5, save_every=2, stop=None), Attempt(until=6, resume=3)])
    with pytest.raises(LineageError, match="resumes from step 3"):
        replay(tmp_path)


def test_a_skipped_step_is_refused_with_its_line(tmp_path):
    from sft_runtime.events import open_log
    from tests.support.logbuild import step_event

    with open_log(tmp_path, fsync=False) as log:
        log.append(step_event(1))
        log.append(step_event(3))
    with pytest.raises(LineageError, match="line 2: step 3 committed after step 1"):
        replay(tmp_path)


def test_checkpoint_that_disagrees_with_the_fold_is_refused(tmp_path):
    from sft_runtime.events import CheckpointSaved, open_log
    from tests.support.logbuild import step_event

    with open_log(tmp_path, fsync=False) as log:
        log.append(step_event(1))
        log.append(
            CheckpointSaved(
                step=1, path="p", total_steps=1, consumed_samples=999, total_valid_tokens=101
            )
        )
    with pytest.raises(LineageError, match=r"line 2: .*999.*folds to \(1, 8, 101\)"):
        replay(tmp_path)


def test_a_rolled_back_checkpoint_that_disagrees_does_not_count(tmp_path):
    """Only a checkpoint in effect must agree with the fold; the one-pass fold of the whole
    log hands such a log to the fold of the records in effect, which gives the same answer."""
    from sft_runtime.events import CheckpointSaved, RunStarted, open_log
    from sft_runtime.states import apply, initial_save_state
    from tests.support.logbuild import PLACEMENT, step_event

    def saved(step: int, samples: int) -> CheckpointSaved:
        return CheckpointSaved(
            step=step,
            path=f"p{step}",
            total_steps=step,
            consumed_samples=samples,
            total_valid_tokens=sum(100 + s for s in range(1, step + 1)),
        )

    with open_log(tmp_path, fsync=False) as log:
        log.append(RunStarted(placement_hash=PLACEMENT))
        for step in (1, 2):
            log.append(step_event(step))
        log.append(saved(2, 16))
        log.append(step_event(3))
        log.append(saved(3, 999))  # wrong, and rolled back by the resume below
    with open_log(tmp_path, fsync=False) as log:  # the next attempt
        log.append(RunStarted(placement_hash=PLACEMENT, resumed_from_step=2))
        for step in (3, 4):
            log.append(step_event(step))
    state = replay(tmp_path)
    assert (state.total_steps, state.consumed_samples, state.total_valid_tokens) == tuple(
        totals_at(4)
    )
    folded = initial_save_state()
    for rec in records_in_effect(read_log(tmp_path)):
        folded = apply(folded, rec)
    assert folded == state
    with open_log(tmp_path, fsync=False) as log:  # the same mistake, now in effect
        log.append(saved(4, 999))
    with pytest.raises(LineageError, match=r"line 10: .*999"):
        replay(tmp_path)

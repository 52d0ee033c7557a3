"""Property tests: valid histories survive write -> read -> replay; damage never goes unseen."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sft_runtime.events import EventLogCorrupted, EventLogError, open_log, read_log
from sft_runtime.events.lineage import records_in_effect
from sft_runtime.states import apply, initial_save_state, replay
from tests.support.logbuild import Attempt, step_event, totals_at, write_run

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def run_plans(draw) -> list[Attempt]:
    """Launch histories a real run could produce: resumes only from saved checkpoints."""
    attempts, last_step, saved = [], 0, {0}
    for i in range(draw(st.integers(1, 4))):
        resume = None
        if i > 0:
            resume = draw(st.sampled_from(sorted(saved)))
            last_step = resume
            saved = {s for s in saved if s <= resume}
        until = last_step + draw(st.integers(0, 6))
        save_every = draw(st.integers(0, 3))
        abort_at = draw(st.one_of(st.none(), st.integers(last_step + 1, last_step + 7)))
        stop = draw(st.sampled_from([None, "completed", "interrupted", "failed"]))
        attempts.append(Attempt(until, resume or None, save_every, stop, abort_at))
        if save_every:
            saved |= {s for s in range(last_step + 1, until + 1) if s % save_every == 0}
        last_step = until
    return attempts


_WRITTEN: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _remove_written():
    """Hypothesis runs each test many times in one call: the folders go at the end."""
    yield
    while _WRITTEN:
        shutil.rmtree(_WRITTEN.pop(), ignore_errors=True)


def _write(plan: list[Attempt]) -> Path:
    run_dir = Path(tempfile.mkdtemp(prefix="sftlog-"))
    _WRITTEN.append(run_dir)
    write_run(run_dir, plan)
    return run_dir


@SETTINGS
@given(plan=run_plans())
def test_valid_histories_survive_write_read_replay(plan):
    run_dir = _write(plan)
    records = list(read_log(run_dir, validate=True))
    assert [r.seq for r in records] == list(range(len(records)))
    for rec in records:
        if rec.type == "step_committed":
            assert rec.data == step_event(rec.data["step"]).model_dump(mode="json")
    final = replay(run_dir)
    expected = totals_at(plan[-1].until)
    assert [final.total_steps, final.consumed_samples, final.total_valid_tokens] == expected
    for step in range(plan[-1].until + 1):
        assert replay(run_dir, until_step=step).total_steps == step
    folded = initial_save_state()
    for rec in records_in_effect(read_log(run_dir)):
        folded = apply(folded, rec)
    assert folded == final  # the inline fold of replay is the pure fold


def _line_of(data: bytes, pos: int) -> int:
    return data.count(b"\n", 0, pos) + 1


@SETTINGS
@given(plan=run_plans(), cut=st.floats(0, 1))
def test_any_truncation_is_a_shorter_log_or_a_repaired_torn_tail(plan, cut):
    run_dir = _write(plan)
    path = run_dir / "events.jsonl"
    data = path.read_bytes()
    n = int(cut * len(data))
    path.write_bytes(data[:n])
    complete = data[:n].count(b"\n")
    reader = read_log(path)
    assert len(list(reader)) == complete
    torn = n - (data.rfind(b"\n", 0, n) + 1)
    assert reader.torn_bytes == torn
    replay(path)  # a prefix of a valid history is a valid history
    with open_log(run_dir, fsync=False) as log:
        assert (log.repaired is not None) == (torn > 0)
        if torn:
            assert log.repaired.dropped_bytes == torn and log.repaired.at_line == complete + 1
    assert len(list(read_log(path, validate=True))) == complete + (1 if torn else 0)


@SETTINGS
@given(plan=run_plans(), where=st.floats(0, 1), mask=st.integers(1, 255))
def test_any_byte_flip_is_repaired_or_reported_at_its_line(plan, where, mask):
    run_dir = _write(plan)
    path = run_dir / "events.jsonl"
    data = bytearray(path.read_bytes())
    pos = min(int(where * len(data)), len(data) - 1)
    data[pos] ^= mask
    path.write_bytes(bytes(data))
    expected_line = _line_of(bytes(data), pos)
    reader = read_log(path, validate=True)
    try:
        list(reader)
    except EventLogCorrupted as err:
        assert err.line == expected_line, (err, pos)
    else:
        # only the last line's newline can be flipped without a report: it becomes a torn tail
        assert pos == len(data) - 1 and reader.torn_bytes > 0
    try:
        with open_log(run_dir, fsync=False) as log:
            assert log.repaired is not None
    except EventLogError as err:
        assert isinstance(err, EventLogCorrupted) and err.line == expected_line

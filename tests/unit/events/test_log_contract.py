"""One contract, two stores: the in-memory log and the file-backed log behave the same."""

from __future__ import annotations

import pytest

from sft_runtime.events import EventLog, open_log
from tests.support.logbuild import Attempt, run_attempt


@pytest.fixture(params=["memory", "file"])
def log(request, tmp_path):
    log = EventLog.in_memory() if request.param == "memory" else open_log(tmp_path, fsync=False)
    yield log
    log.close()


def test_appended_records_read_back_verified(log):
    run_attempt(log, Attempt(until=4, save_every=2), [0, 0, 0])
    records = list(log.records(validate=True))
    assert [r.seq for r in records] == list(range(log.next_seq))
    assert records[-1].digest == log.last_digest
    assert [r.data["step"] for r in records if r.type == "step_committed"] == [1, 2, 3, 4]
    assert [r.data["step"] for r in records if r.type == "checkpoint_saved"] == [2, 4]


def test_returned_record_matches_the_stored_one(log):
    run_attempt(log, Attempt(until=1, stop=None), [0, 0, 0])
    stored = list(log.records())
    from tests.support.logbuild import step_event

    rec = log.append(step_event(2))
    again = list(log.records())[-1]
    assert (rec.seq, rec.prev, rec.digest, rec.data) == (
        again.seq,
        again.prev,
        again.digest,
        again.data,
    )
    assert rec.prev == stored[-1].digest


def test_first_attempt_is_one(log):
    assert log.attempt == 1 and log.next_seq == 0 and log.repaired is None

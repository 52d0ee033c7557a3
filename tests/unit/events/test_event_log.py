"""The JSONL log: chain, sequence, durability hooks, repair of a torn tail, the writer lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import orjson
import pytest

from sft_runtime.events import (
    EventLog,
    EventLogCorrupted,
    EventLogError,
    EventLogLocked,
    RunStarted,
    open_log,
    read_log,
)
from sft_runtime.events.schemas import UPCASTERS, StepCommitted
from tests.support.logbuild import Attempt, step_event, write_run


def _lines(path):
    return path.read_bytes().splitlines(keepends=True)


def test_records_round_trip_with_seq_chain_and_attempt(tmp_path):
    path = write_run(tmp_path, [Attempt(until=3)])
    records = list(read_log(tmp_path, validate=True))
    assert [r.seq for r in records] == list(range(len(records)))
    assert [r.type for r in records][:3] == ["run_started", "loaders_ready", "step_committed"]
    assert records[0].prev == "0" * 64
    assert all(b.prev == a.digest for a, b in zip(records, records[1:], strict=False))
    assert {r.attempt for r in records} == {1}
    assert records[2].data["sample_digests"] == step_event(1).sample_digests
    assert [r.line for r in records] == list(range(1, len(records) + 1))
    assert len(_lines(path)) == len(records)


def test_each_reopen_is_a_new_attempt_and_continues_the_chain(tmp_path):
    write_run(tmp_path, [Attempt(until=2, save_every=2), Attempt(until=4, resume=2)])
    records = list(read_log(tmp_path))
    assert sorted({r.attempt for r in records}) == [1, 2]
    first_of_two = next(r for r in records if r.attempt == 2)
    assert first_of_two.type == "run_started" and first_of_two.data["resumed_from_step"] == 2


def test_append_fsyncs_only_durable_types(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    with open_log(tmp_path) as log:
        synced.clear()
        log.append(RunStarted(placement_hash="h"))
        assert synced == []
        log.append(step_event(1))
        assert len(synced) == 1
        log.append(RunStarted(placement_hash="h"), durable=True)
        assert len(synced) == 2
        log.append(step_event(2), durable=False)
        assert len(synced) == 2


def test_torn_tail_is_cut_and_recorded(tmp_path):
    path = write_run(tmp_path, [Attempt(until=3, stop=None)])
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"attempt":1,"data":{"step"')  # crash mid-write
    with open_log(tmp_path) as log:
        assert log.repaired is not None and log.repaired.dropped_bytes == 27
        assert log.attempt == 2
    records = list(read_log(tmp_path, validate=True))
    assert records[-1].type == "log_repaired"
    assert records[-1].data["at_line"] == len(whole.splitlines()) + 1
    assert path.read_bytes().startswith(whole)


def test_torn_tail_without_newline_is_dropped_even_if_it_parses(tmp_path):
    path = write_run(tmp_path, [Attempt(until=2, stop=None)])
    path.write_bytes(path.read_bytes()[:-1])  # the newline of the last record never made it
    reader = read_log(tmp_path)
    n = len(list(reader))
    assert reader.torn_bytes > 0
    with open_log(tmp_path) as log:
        assert log.repaired is not None
    assert len(list(read_log(tmp_path))) == n + 1  # kept records + log_repaired


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda ls, i: ls.__setitem__(i, ls[i].replace(b'"step":2', b'"step":9')), "digest"),
        (lambda ls, i: ls.__delitem__(i), "seq"),
        (lambda ls, i: ls.insert(i, ls[i - 1]), "seq"),
        (lambda ls, i: ls.__setitem__(i, b"not json\n"), "not a record line"),
        (lambda ls, i: ls.__setitem__(i, b"\n"), "not a record line"),
        (lambda ls, i: ls.__setitem__(i - 1, ls[i]) or ls.__setitem__(i, ls[i - 1]), "seq"),
    ],
    ids=["edited", "dropped", "duplicated", "garbage", "empty", "swapped"],
)
def test_damage_in_the_middle_names_the_line(tmp_path, damage, reason):
    path = write_run(tmp_path, [Attempt(until=5)])
    lines = _lines(path)
    target = 3  # 0-based index of the line holding step 2
    assert b'"step":2' in lines[target]
    damage(lines, target)
    path.write_bytes(b"".join(lines))
    with pytest.raises(EventLogCorrupted) as err:
        list(read_log(tmp_path))
    assert err.value.line in (target, target + 1)
    assert reason in str(err.value)
    assert str(path) in str(err.value)
    with pytest.raises(EventLogCorrupted):
        open_log(tmp_path)  # a writer refuses too, and leaves the file alone
    assert path.read_bytes() == b"".join(lines)


def test_unknown_future_type_is_reported_with_its_line(tmp_path):
    log = EventLog.in_memory()
    log.append(RunStarted(placement_hash="h"))
    from sft_runtime.events.schemas import encode

    line, _ = encode(1, "model_merged", time.time(), 1, {"x": 1}, log.last_digest)
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(log._sink.lines()) + line + b"\n")
    with pytest.raises(EventLogCorrupted, match="line 2: unknown event type 'model_merged'"):
        list(read_log(path))


def test_newer_schema_version_is_refused_and_older_is_upcast(tmp_path):
    from sft_runtime.events.schemas import encode

    data = step_event(1).model_dump(mode="json")
    newer = dict(data, schema_version=7)
    line, _ = encode(0, "step_committed", 1.0, 1, newer, "0" * 64)
    (tmp_path / "events.jsonl").write_bytes(line + b"\n")
    with pytest.raises(EventLogCorrupted, match="newer than this release"):
        list(read_log(tmp_path))

    older = {k: v for k, v in data.items() if k != "span_id"}
    older["schema_version"] = 0
    line, _ = encode(0, "step_committed", 1.0, 1, older, "0" * 64)
    (tmp_path / "events.jsonl").write_bytes(line + b"\n")
    UPCASTERS[("step_committed", 0)] = lambda d: dict(d, span_id="upcast", schema_version=1)
    try:
        (rec,) = read_log(tmp_path, validate=True)
    finally:
        del UPCASTERS[("step_committed", 0)]
    assert rec.data["span_id"] == "upcast"
    assert StepCommitted.model_validate(rec.data).step == 1


def test_invalid_payload_is_refused_when_validating(tmp_path):
    from sft_runtime.events.schemas import encode

    bad = dict(step_event(1).model_dump(mode="json"), step=0)
    line, _ = encode(0, "step_committed", 1.0, 1, bad, "0" * 64)
    (tmp_path / "events.jsonl").write_bytes(line + b"\n")
    assert len(list(read_log(tmp_path))) == 1  # structure and chain are fine
    with pytest.raises(EventLogCorrupted, match="line 1: step_committed payload"):
        list(read_log(tmp_path, validate=True))


def test_second_writer_in_the_same_process_is_refused(tmp_path):
    with open_log(tmp_path):
        with pytest.raises(EventLogLocked, match=str(os.getpid())):
            open_log(tmp_path)
    with open_log(tmp_path):  # released on close
        pass


def test_lock_dies_with_its_process(tmp_path):
    code = (
        "import sys, time; from events import open_log; log = open_log(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(EventLogLocked, match=f"pid {proc.pid}"):
            open_log(tmp_path)
        proc.kill()
        proc.wait()
        with open_log(tmp_path) as log:  # the kernel released the lock with the process
            assert log.attempt == 1
    finally:
        proc.kill()


def test_failed_write_leaves_no_partial_line(tmp_path, monkeypatch):
    with open_log(tmp_path, fsync=False) as log:
        log.append(RunStarted(placement_hash="h"))
        before = (tmp_path / "events.jsonl").read_bytes()
        real_write = os.write

        def short_then_fail(fd, data):
            if len(data) > 20:
                real_write(fd, bytes(data[:20]))
                raise OSError(28, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", short_then_fail)
        with pytest.raises(OSError, match="No space"):
            log.append(step_event(1))
        monkeypatch.setattr(os, "write", real_write)
        assert (tmp_path / "events.jsonl").read_bytes() == before
        log.append(step_event(1))  # the chain continues where it stood
    assert [r.type for r in read_log(tmp_path)] == ["run_started", "step_committed"]


def test_reading_streams_instead_of_loading_the_file(tmp_path):
    write_run(tmp_path, [Attempt(until=50)])
    reader = read_log(tmp_path)
    it = iter(reader)
    first = next(it)
    assert first.seq == 0 and reader.state.lines == 1  # only one line consumed so far


def test_missing_log_is_a_clear_error(tmp_path):
    with pytest.raises(EventLogError, match="no event log"):
        read_log(tmp_path / "nowhere")


def test_closed_log_refuses_appends():
    log = EventLog.in_memory()
    log.close()
    with pytest.raises(EventLogError, match="closed"):
        log.append(RunStarted(placement_hash="h"))


def test_lines_are_canonical_sorted_json_with_digest_last(tmp_path):
    path = write_run(tmp_path, [Attempt(until=1)])
    line = _lines(path)[0].rstrip(b"\n")
    parsed = orjson.loads(line)
    assert list(parsed)[-1] == "digest"
    keys = [k for k in parsed if k != "digest"]
    assert keys == sorted(keys)

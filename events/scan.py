"""Streaming verification of a log's lines: envelope, digest, chain, sequence, type.

Used by readers and by the writer when it opens a log. A line without its newline at the
very end of the file is a torn tail (a crash mid-write); anything else that fails a check
raises `EventLogCorrupted` naming the line. This loop is the cost of every replay, so the
common case (a well-formed line at the current schema version) is checked inline.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from events.errors import EventLogCorrupted
from events.record import _DIGEST_PREFIX, _SUFFIX_LEN, GENESIS, Record
from events.schemas import EVENT_TYPES, VERSIONS, parse_payload, upcast

_FIELDS = {"seq": 0, "type": 0, "time": 0, "attempt": 0, "data": 0, "prev": 0, "digest": 0}.keys()
_sha256 = hashlib.sha256


@dataclass
class ScanState:
    """Where a scan got to: what the next record must carry, and any torn tail."""

    next_seq: int = 0
    prev: str = GENESIS
    max_attempt: int = 0
    good_bytes: int = 0
    lines: int = 0
    torn_bytes: int = 0
    torn_line: int = 0


def scan_lines(
    lines: Iterable[bytes], path: Path | str, state: ScanState, *, validate: bool = False
) -> Iterator[Record]:
    """Yield verified records from raw lines (each with its newline, as a file yields them).

    ``validate`` also checks each payload against its pydantic model; without it only the
    schema version is checked, which is what keeps replay close to bare parsing speed.
    """
    seq, prev, attempt_floor = state.next_seq, state.prev, max(1, state.max_attempt)
    lineno, good = state.lines, state.good_bytes
    for raw in lines:
        lineno += 1
        if raw[-1:] != b"\n":
            state.torn_bytes, state.torn_line = len(raw), lineno
            return
        end = len(raw) - 1
        if raw[end - _SUFFIX_LEN : end - 66] != _DIGEST_PREFIX or raw[end - 2 : end] != b'"}':
            raise _corrupt(path, lineno, "not a record line (no trailing digest field)")
        digest = raw[end - 66 : end - 2].decode("ascii", "replace")
        if _sha256(raw[: end - _SUFFIX_LEN] + b"}").hexdigest() != digest:
            raise _corrupt(
                path, lineno, "digest mismatch: the line was changed after it was written"
            )
        try:
            f = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _corrupt(path, lineno, f"invalid JSON ({exc})") from None
        if type(f) is not dict or f.keys() != _FIELDS:
            raise _corrupt(path, lineno, "a record must have exactly the envelope fields")
        type_, attempt, data = f["type"], f["attempt"], f["data"]
        if f["seq"] != seq or type(f["seq"]) is not int:
            raise _corrupt(path, lineno, f"seq {f['seq']!r} where {seq} was expected")
        if f["prev"] != prev:
            raise _corrupt(path, lineno, "prev does not match the previous record's digest")
        version = VERSIONS.get(type_)
        if version is None:
            raise _corrupt(
                path, lineno, f"unknown event type {type_!r} (written by a newer sft-runtime?)"
            )
        if type(attempt) is not int or attempt < attempt_floor:
            raise _corrupt(path, lineno, f"attempt {attempt!r} goes backwards or is < 1")
        if type(data) is not dict or type(f["time"]) not in (float, int):
            raise _corrupt(path, lineno, "data must be an object and time a number")
        if validate or data.get("schema_version", 1) != version:
            data = _upgrade(type_, data, validate, path, lineno)
        record = Record(seq, type_, f["time"], attempt, data, prev, digest, lineno)
        seq, prev, attempt_floor = seq + 1, digest, attempt
        good += end + 1
        state.next_seq, state.prev, state.max_attempt = seq, prev, attempt
        state.lines, state.good_bytes = lineno, good
        yield record


def _upgrade(type_: str, data: dict, validate: bool, path: Path | str, lineno: int) -> dict:
    try:
        data = upcast(type_, data)
        if validate:
            parse_payload(type_, data)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        reason = str(exc).splitlines()[0]
        raise _corrupt(path, lineno, f"{type_} payload: {reason}") from None
    return data


def _corrupt(path: Path | str, lineno: int, reason: str) -> EventLogCorrupted:
    return EventLogCorrupted(path, lineno, reason)


__all__ = ["EVENT_TYPES", "ScanState", "scan_lines"]

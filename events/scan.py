"""Streaming verification of a log's lines: envelope, digest, chain, sequence, type.

Used by readers and by the writer when it opens a log. A line without its newline at the
very end of the file is a torn tail (a crash mid-write); anything else that fails a check
raises `EventLogCorrupted` naming the line. This loop is the cost of every replay, so the
common case (a well-formed line at the current schema version) is checked inline.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from sft_runtime.events.errors import EventLogCorrupted
from sft_runtime.events.record import _DIGEST_PREFIX, _SUFFIX_LEN, GENESIS, Record
from sft_runtime.events.schemas import EVENT_TYPES, VERSIONS, parse_payload, upcast

_sha256 = hashlib.sha256
_new_record = tuple.__new__  # Record(...) without the named tuple's Python-level __new__


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
    lines: Iterable[bytes],
    path: Path | str,
    state: ScanState,
    *,
    validate: bool = False,
    close: Callable[[], None] | None = None,
) -> Iterator[Record]:
    """Yield verified records from raw lines (each with its newline, as a file yields them).

    ``validate`` also checks each payload against its pydantic model; without it only the
    schema version is checked, which is what keeps replay close to bare parsing speed.
    ``close`` is called when the scan ends, however it ends (a reader's file).
    """
    try:
        seq, prev, floor = state.next_seq, state.prev, state.max_attempt
        done, good = state.lines, state.good_bytes  # lines and bytes verified so far
        for raw in lines:
            lineno = done + 1
            if raw[-1] != 10:  # no newline: a torn tail
                state.torn_bytes, state.torn_line = len(raw), lineno
                return
            end = len(raw) - 1
            if not (raw.startswith(_DIGEST_PREFIX, end - _SUFFIX_LEN) and raw.endswith(b'"}\n')):
                raise _corrupt(path, lineno, "not a record line (no trailing digest field)")
            digest = _sha256(raw[: end - _SUFFIX_LEN] + b"}").hexdigest()
            try:
                f = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                _check_digest(raw, end, digest, path, lineno)  # a changed line says so first
                raise _corrupt(path, lineno, f"invalid JSON ({exc})") from None
            try:  # seven fields, each of these names: exactly the envelope
                if len(f) != 7 or f["digest"] != digest:
                    raise KeyError("digest")
                type_, attempt, data, time_ = f["type"], f["attempt"], f["data"], f["time"]
                f_seq, f_prev = f["seq"], f["prev"]
            except (KeyError, TypeError):
                _check_digest(raw, end, digest, path, lineno)
                raise _corrupt(
                    path, lineno, "a record must have exactly the envelope fields"
                ) from None
            if f_seq != seq or type(f_seq) is not int:
                raise _corrupt(path, lineno, f"seq {f_seq!r} where {seq} was expected")
            if f_prev != prev:
                raise _corrupt(path, lineno, "prev does not match the previous record's digest")
            version = VERSIONS.get(type_)
            if version is None:
                raise _corrupt(
                    path, lineno, f"unknown event type {type_!r} (written by a newer sft-runtime?)"
                )
            if type(attempt) is not int or attempt < floor or attempt < 1:
                raise _corrupt(path, lineno, f"attempt {attempt!r} goes backwards or is < 1")
            if type(data) is not dict or type(time_) not in (float, int):
                raise _corrupt(path, lineno, "data must be an object and time a number")
            if validate or data.get("schema_version", 1) != version:
                data = _upgrade(type_, data, validate, path, lineno)
            record = _new_record(Record, (seq, type_, time_, attempt, data, prev, digest, lineno))
            seq, prev, floor, done, good = seq + 1, digest, attempt, lineno, good + end + 1
            state.lines = done  # the rest of the state is written back when the scan ends
            yield record
    finally:
        state.next_seq, state.prev, state.max_attempt = seq, prev, floor
        state.good_bytes = good
        if close is not None:
            close()


def _check_digest(raw: bytes, end: int, digest: str, path: Path | str, lineno: int) -> None:
    """Raise the digest error when the line's digest field does not match its bytes."""
    if raw[end - 66 : end - 2] != digest.encode():
        raise _corrupt(path, lineno, "digest mismatch: the line was changed after it was written")


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

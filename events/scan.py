"""Streaming verification of a log's lines: envelope, digest, chain, sequence, type.

Used by readers and by the writer when it opens a log. A line without its newline at the
very end of the file is a torn tail (a crash mid-write); anything else that fails a check
raises `EventLogCorrupted` naming the line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from events.errors import EventLogCorrupted
from events.record import GENESIS, Record, decode
from events.schemas import EVENT_TYPES, parse_payload, upcast

_FIELDS = frozenset({"seq", "type", "time", "attempt", "data", "prev", "digest"})


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
    for raw in lines:
        lineno = state.lines + 1
        if not raw.endswith(b"\n"):
            state.torn_bytes = len(raw)
            state.torn_line = lineno
            return
        state.lines = lineno
        record = _check(raw[:-1], lineno, path, state, validate)
        state.good_bytes += len(raw)
        yield record


def _check(raw: bytes, lineno: int, path: Path | str, state: ScanState, validate: bool) -> Record:
    try:
        fields, digest = decode(raw)
    except ValueError as exc:
        raise EventLogCorrupted(path, lineno, str(exc)) from None
    if fields.keys() != _FIELDS:
        raise EventLogCorrupted(path, lineno, f"unexpected fields {sorted(fields)}")
    seq, type_, attempt, data = fields["seq"], fields["type"], fields["attempt"], fields["data"]
    if type(seq) is not int or seq != state.next_seq:
        raise EventLogCorrupted(path, lineno, f"seq {seq!r} where {state.next_seq} was expected")
    if fields["prev"] != state.prev:
        raise EventLogCorrupted(path, lineno, "prev does not match the previous record's digest")
    if type_ not in EVENT_TYPES:
        raise EventLogCorrupted(
            path, lineno, f"unknown event type {type_!r} (written by a newer sft-runtime?)"
        )
    if type(attempt) is not int or attempt < max(1, state.max_attempt):
        raise EventLogCorrupted(path, lineno, f"attempt {attempt!r} goes backwards or is < 1")
    if not isinstance(data, dict) or not isinstance(fields["time"], int | float):
        raise EventLogCorrupted(path, lineno, "data must be an object and time a number")
    try:
        data = upcast(type_, data)
        if validate:
            parse_payload(type_, data)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        reason = str(exc).splitlines()[0] if validate else str(exc)
        raise EventLogCorrupted(path, lineno, f"{type_} payload: {reason}") from None
    state.next_seq = seq + 1
    state.prev = digest
    state.max_attempt = attempt
    return Record(seq, type_, float(fields["time"]), attempt, data, fields["prev"], digest, lineno)

"""The append-only JSONL log of one run directory: one writer, many readers.

The writer holds an advisory lock that the kernel drops when its process dies, so a crashed
run never blocks its own resume, while a second live run on the same directory is refused.
Opening for write verifies the whole chain and cuts off a torn last line, recording the cut
as a `log_repaired` event so the repair itself is part of the history.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time as _time
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson

from sft_runtime.events.errors import EventLogError, EventLogLocked
from sft_runtime.events.scan import ScanState, scan_lines
from sft_runtime.events.schemas import (
    _SUFFIX_LEN,
    EventPayload,
    LogRepaired,
    Record,
    encode,
    json_safe,
)

_RUN_STARTED = b'"type":"run_started"'
_TAIL_BYTES = 1 << 20  # far more than one record
_BLOCK_BYTES = 1 << 22  # what `resume_points` reads at a time
LOG_NAME = "events.jsonl"
LOCK_NAME = "events.lock"
DURABLE_TYPES = frozenset(
    {"step_committed", "step_aborted", "checkpoint_saved", "run_stopped", "log_repaired"}
)


def log_path(run_dir_or_file: Path | str) -> Path:
    """Accept a run directory or the events file itself."""
    path = Path(run_dir_or_file)
    return path if path.suffix == ".jsonl" else path / LOG_NAME


class LogReader:
    """Streams verified records of a log file; `torn_bytes` is set once iteration ends."""

    def __init__(self, path: Path | str, *, validate: bool = False) -> None:
        self.path = log_path(path)
        if not self.path.is_file():
            raise EventLogError(f"{self.path}: no event log here")
        self.validate = validate
        self.state = ScanState()

    def __iter__(self) -> Iterator[Record]:
        self.state = ScanState()
        fh = open(self.path, "rb", buffering=1 << 20)  # noqa: SIM115 - closed by the scan
        return scan_lines(fh, self.path, self.state, validate=self.validate, close=fh.close)

    @property
    def torn_bytes(self) -> int:
        return self.state.torn_bytes

    def resume_points(self) -> list[tuple[int, int]]:
        """(attempt, resumed_from_step or 0) of every run_started, without a full parse.

        Sorted keys put ``"type"`` last before the digest, so a run_started line is found by
        its ending. The file is searched in large blocks for that marker (a few run_started
        among a million lines), and only the lines holding it are looked at. The lines are
        not verified here: callers also make a verifying pass, which raises on any damage
        before a result is returned.
        """
        points = []
        with open(self.path, "rb", buffering=0) as fh:
            for raw in _marked_lines(fh, _RUN_STARTED):
                if raw.endswith(_RUN_STARTED, 0, len(raw) - _SUFFIX_LEN - 1):  # no copy
                    try:
                        f = orjson.loads(raw)
                        points.append((f["attempt"], f["data"].get("resumed_from_step") or 0))
                    except (orjson.JSONDecodeError, KeyError, AttributeError, TypeError):
                        continue  # the verifying pass reports this line
        return points


def _marked_lines(fh, marker: bytes) -> Iterator[bytes]:
    """The lines of ``fh`` (each with its newline, the last one perhaps without) that
    contain ``marker``, in order. Blocks are searched at C speed and cut only around a hit,
    so the lines without it cost no Python work."""
    carry = b""  # the unfinished last line of the blocks read so far
    while True:
        block = fh.read(_BLOCK_BYTES)
        if not block:
            if marker in carry:
                yield carry
            return
        first = block.find(b"\n") + 1  # the line that began in an earlier block ends here
        if first == 0:
            carry += block
            continue
        line = carry + block[:first]
        if marker in line:
            yield line
        cut = block.rfind(b"\n") + 1  # whole lines end here; the rest goes on
        carry = block[cut:]
        hit = block.find(marker, first, cut)
        while hit >= 0:
            start = block.rfind(b"\n", 0, hit) + 1
            end = block.index(b"\n", hit) + 1
            yield block[start:end]
            hit = block.find(marker, end, cut)


def next_attempt(run_dir_or_file: Path | str) -> int:
    """The attempt number the next writer of this log will get (1 for a new run), read
    from the log's tail without a lock or a full scan: attempts only grow, so the last whole
    line holds the largest. For labelling what a process does before it opens the log (its
    telemetry resource); the writer's own `EventLog.attempt` is the record of truth."""
    path = log_path(run_dir_or_file)
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _TAIL_BYTES))
            tail = fh.read()
    except FileNotFoundError:
        return 1
    for raw in reversed(tail.split(b"\n")):
        try:
            return int(orjson.loads(raw)["attempt"]) + 1
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn tail, or the cut-off first line of the window
    return 1


def read_log(path: Path | str, *, validate: bool = False) -> LogReader:
    """A read-only, streaming view of ``<run_dir>/events.jsonl``; takes no lock."""
    return LogReader(path, validate=validate)


class _MemorySink:
    """Bytes in memory: the same log logic without a file, for tests and dry runs."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def write(self, data: bytes, durable: bool) -> None:
        self.buffer += data

    def size(self) -> int:
        return len(self.buffer)

    def truncate(self, size: int) -> None:
        del self.buffer[size:]

    def lines(self) -> Iterable[bytes]:
        return bytes(self.buffer).splitlines(keepends=True)

    def close(self) -> None:
        pass


class _FileSink:
    """An O_APPEND file descriptor; a failed write is cut back so no partial line stays."""

    def __init__(self, path: Path, fsync: bool) -> None:
        created = not path.exists()
        self.path = path
        self.fsync = fsync
        self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        if created and fsync:
            fsync_dir(path.parent)

    def write(self, data: bytes, durable: bool) -> None:
        start = self.size()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
            if durable and self.fsync:
                os.fsync(self.fd)
        except BaseException as exc:
            os.ftruncate(self.fd, start)
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = str(self.path)  # "No space left on device: '.../events.jsonl'"
            raise

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        if self.fsync:
            os.fsync(self.fd)

    def lines(self) -> Iterable[bytes]:
        with open(self.path, "rb", buffering=1 << 20) as fh:
            yield from fh

    def close(self) -> None:
        os.close(self.fd)


class EventLog:
    """The single writer of a log. Use `open_log(run_dir)` or `EventLog.in_memory()`."""

    def __init__(self, sink, path: Path | str, *, durable_types=DURABLE_TYPES, lock_fd=None):
        self._sink = sink
        self.path = Path(path)
        self.durable_types = frozenset(durable_types)
        self._lock_fd = lock_fd
        self.repaired: LogRepaired | None = None
        self._state = ScanState()
        for _ in scan_lines(sink.lines(), self.path, self._state, validate=True):
            pass
        self.attempt = self._state.max_attempt + 1
        if self._state.torn_bytes:
            sink.truncate(self._state.good_bytes)
            self.repaired = LogRepaired(
                dropped_bytes=self._state.torn_bytes,
                at_line=self._state.torn_line,
                reason="torn last line (the process stopped mid-write)",
            )
            self.append(self.repaired)

    @classmethod
    def in_memory(cls, *, durable_types=DURABLE_TYPES) -> EventLog:
        return cls(_MemorySink(), "<memory>", durable_types=durable_types)

    @property
    def next_seq(self) -> int:
        return self._state.next_seq

    @property
    def last_digest(self) -> str:
        return self._state.prev

    def append(
        self, payload: EventPayload, *, durable: bool | None = None, time: float | None = None
    ) -> Record:
        """Write one record (flushed; fsynced when durable) and return it."""
        if self._sink is None:
            raise EventLogError(f"{self.path}: the log is closed")
        type_ = payload.event_type
        data = json_safe(payload.model_dump(mode="json"))
        now = _time.time() if time is None else time
        seq, prev = self._state.next_seq, self._state.prev
        line, digest = encode(seq, type_, now, self.attempt, data, prev)
        if durable is None:
            durable = type_ in self.durable_types
        self._sink.write(line + b"\n", durable)
        self._state.next_seq = seq + 1
        self._state.lines += 1
        self._state.prev = digest
        return Record(seq, type_, now, self.attempt, data, prev, digest, self._state.lines)

    def records(self, *, validate: bool = False) -> Iterator[Record]:
        """Everything written so far, verified again from storage."""
        return scan_lines(self._sink.lines(), self.path, ScanState(), validate=validate)

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_log(
    run_dir: Path | str,
    *,
    durable_types=DURABLE_TYPES,
    fsync: bool = True,
    owner: dict | None = None,
) -> EventLog:
    """Open (creating if needed) ``<run_dir>/events.jsonl`` for writing, under the run lock.

    ``owner`` (plain data, e.g. the driver's pid and host) is written into the lock file
    next to this process's pid and host, so a refused run can say who holds the directory.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = acquire_lock(run_dir / LOCK_NAME, owner)
    try:
        sink = _FileSink(run_dir / LOG_NAME, fsync)
        try:
            return EventLog(sink, sink.path, durable_types=durable_types, lock_fd=lock_fd)
        except BaseException:
            sink.close()
            raise
    except BaseException:
        os.close(lock_fd)
        raise


def lock_holder(path: Path) -> dict:
    """What the lock file says about its holder ({} when it says nothing readable)."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def acquire_lock(path: Path, owner: dict | None = None) -> int:
    """Take the run directory's lock (released by the kernel when the process dies)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = lock_holder(path)
        who = f"pid {holder.get('pid', 'unknown')} on {holder.get('host', 'an unknown host')}"
        raise EventLogLocked(
            f"{path.parent} is already being written by another run ({who}); "
            "stop that run or choose another run directory"
        ) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), **(owner or {})}
    os.ftruncate(fd, 0)
    os.pwrite(fd, orjson.dumps(info), 0)
    return fd


def fsync_dir(path: Path | str) -> None:
    """Make a directory's entries (a new or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

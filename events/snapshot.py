"""A log as it stood at one moment, however much a live writer appends meanwhile.

A `LogReader` opens the file afresh on every pass, and a fold of the records in effect
takes several passes (the resume points, then the records): on a log that a live run is
appending to, each pass may see more lines than the one before. `LogSnapshot` fixes the
size when it is made, so every pass reads the same lines, and a check built on it (what
`verify` concludes about the checkpoints those lines record) never mixes two moments. A
line the writer had only half written then is a torn tail, as it is for any reader.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import orjson

from sft_runtime.events.log import _RUN_STARTED, LogReader, _marked_lines
from sft_runtime.events.scan import ScanState, scan_lines
from sft_runtime.events.schemas import _SUFFIX_LEN, Record

_BUFFER = 1 << 20


class _Bounded:
    """The first ``size`` bytes of a file, read by lines or by blocks."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self._fh = fh
        self._left = size

    def read(self, n: int) -> bytes:
        data = self._fh.read(min(n, self._left))
        self._left -= len(data)
        return data

    def __iter__(self) -> Iterator[bytes]:
        while self._left > 0:
            line = self._fh.readline(self._left)
            if not line:
                return
            self._left -= len(line)
            yield line

    def close(self) -> None:
        self._fh.close()


class LogSnapshot(LogReader):
    """`LogReader` over the bytes the log held when the snapshot was made."""

    def __init__(self, path: Path | str, *, validate: bool = False) -> None:
        super().__init__(path, validate=validate)
        self.size = self.path.stat().st_size

    def _open(self) -> _Bounded:
        return _Bounded(open(self.path, "rb", buffering=_BUFFER), self.size)  # noqa: SIM115

    def __iter__(self) -> Iterator[Record]:
        self.state = ScanState()
        fh = self._open()
        return scan_lines(fh, self.path, self.state, validate=self.validate, close=fh.close)

    def resume_points(self) -> list[tuple[int, int]]:
        """As `LogReader.resume_points`, within the snapshot: an attempt that started after
        it must not roll back records the snapshot's own passes count."""
        points = []
        fh = self._open()
        try:
            for raw in _marked_lines(fh, _RUN_STARTED):
                if not raw.endswith(b"\n") or not raw.endswith(
                    _RUN_STARTED, 0, len(raw) - _SUFFIX_LEN - 1
                ):
                    continue  # a torn tail, or the marker elsewhere in the line
                try:
                    f = orjson.loads(raw)
                    points.append((f["attempt"], f["data"].get("resumed_from_step") or 0))
                except (orjson.JSONDecodeError, KeyError, AttributeError, TypeError):
                    continue  # the verifying pass reports this line
        finally:
            fh.close()
        return points

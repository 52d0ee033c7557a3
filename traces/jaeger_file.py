"""A span exporter that appends Jaeger JSON spans to this process's part files of a run.

The file layout and the merge that produces the files a user uploads to Jaeger UI are in
`traces.jaeger_json`. This module holds only the SDK-facing exporter, so importing it pulls
in the SDK; only `traces.setup` does.

An exporter runs inside training processes: it never raises. A failed write is reported
once as a warning and the batch is dropped (``SpanExportResult.FAILURE``).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import orjson
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from sft_runtime.traces.jaeger_json import (
    PARTS_DIR,
    part_file_name,
    span_to_jaeger,
    tags,
    trace_dir,
)


class JaegerFileExporter(SpanExporter):
    """Appends spans as JSON lines to ``<run_dir>/traces/parts/<process>.<n>.jsonl``.

    Each part file starts with a header line naming the process (service name and resource
    tags, which become the Jaeger "process"), then one span per line. A part holds at most
    ``max_spans`` spans; the next one is opened after that, so no single file grows without
    bound. Lines are flushed after every batch, so a crash loses at most what the batch
    processor had not yet handed over, and leaves at worst a torn last line.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        process_key: str,
        service_name: str,
        resource_attributes: dict[str, Any],
        attempt: int | None = None,
        max_spans: int = 100_000,
    ) -> None:
        self.dir = trace_dir(run_dir) / PARTS_DIR
        self.process_key = process_key
        self.max_spans = max_spans
        self._header = orjson.dumps(
            {
                "process": {
                    "key": process_key,
                    "serviceName": service_name,
                    "tags": tags(resource_attributes),
                    "attempt": attempt,
                }
            }
        )
        self._lock = threading.Lock()
        self._fh: IO[bytes] | None = None
        self._index = 0
        self._in_part = 0
        self._closed = False
        self._warned = False
        self.paths: list[Path] = []

    def _open_next(self) -> IO[bytes]:
        if self._fh is not None:
            self._fh.close()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._index += 1
        path = self.dir / part_file_name(self.process_key, self._index)
        fh = open(path, "ab")  # noqa: SIM115 - held open across batches, closed in shutdown
        fh.write(self._header + b"\n")
        self._fh, self._in_part = fh, 0
        self.paths.append(path)
        return fh

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        try:
            with self._lock:
                fh = self._fh
                pending = list(spans)
                while pending:
                    if fh is None or self._in_part >= self.max_spans:
                        fh = self._open_next()
                    room = self.max_spans - self._in_part
                    batch, pending = pending[:room], pending[room:]
                    fh.write(b"".join(orjson.dumps(span_to_jaeger(s)) + b"\n" for s in batch))
                    self._in_part += len(batch)
                if fh is not None:
                    fh.flush()
            return SpanExportResult.SUCCESS
        except Exception as exc:  # noqa: BLE001 - an exporter must never break training
            self._warn(exc)
            return SpanExportResult.FAILURE

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"jaeger_file exporter could not write under {self.dir}: "
                f"{type(exc).__name__}: {exc} (spans dropped; further errors not reported)",
                RuntimeWarning,
                stacklevel=2,
            )

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        try:
            with self._lock:
                if self._fh is not None:
                    self._fh.flush()
            return True
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)
            return False

    def shutdown(self) -> None:
        try:
            with self._lock:
                self._closed = True
                if self._fh is not None:
                    self._fh.flush()
                    os.fsync(self._fh.fileno())
                    self._fh.close()
                    self._fh = None
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

"""`merge_trace_files`: all processes' part files -> ``traces/run-attempt<k>.json`` for Jaeger UI.

The driver calls it once at the end of a run (after every process flushed its spans). It
streams, so memory stays bounded by one output file (``max_spans`` spans) however long the
run was:

1. index: one pass over the parts keeps, per trace id, its first start time, span count
   and attempt (a few numbers per trace, not the spans);
2. plan: traces of each attempt, ordered by start, are packed whole into output files of at
   most ``max_spans`` spans (a bigger trace gets a file of its own);
3. spool: a second pass appends each span to the temporary spool of its output file;
4. write: each spool is read back, grouped into Jaeger traces (one process entry per
   exporting process) and written to a temporary name, then renamed.

Part files are never deleted, so a merge can be run again (after a resume, or on a crashed
run) and rewrites the files of every attempt it finds.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from sft_runtime.traces.jaeger_json import (
    attempt_of,
    build_traces,
    merged_name,
    read_parts,
    trace_dir,
    write_json_atomic,
)

MAX_OPEN_SPOOLS = 128  # output files spooled per pass over the parts


def _index(run_dir: Path) -> dict[str, list[Any]]:
    """trace id -> [first start time, span count, attempt or None]."""
    stats: dict[str, list[Any]] = {}
    for span, header in read_parts(run_dir):
        start = span.get("startTime", 0)
        st = stats.get(span["traceID"])
        if st is None:
            st = stats[span["traceID"]] = [start, 0, None]
        st[0] = min(st[0], start)
        st[1] += 1
        attempt = attempt_of(span, header)
        if attempt is not None and (st[2] is None or attempt > st[2]):
            st[2] = attempt
    return stats


def _plan(
    stats: dict[str, list[Any]], max_spans: int, default_attempt: int | None
) -> tuple[dict[str, int], list[tuple[int, int]]]:
    """(trace id -> output number, output number -> (attempt, index within the attempt))."""
    known = [st[2] for st in stats.values() if st[2] is not None]
    fallback = default_attempt or (max(known) if known else 1)
    by_attempt: dict[int, list[tuple[int, str, int]]] = {}
    for trace_id, (start, count, attempt) in stats.items():
        by_attempt.setdefault(attempt or fallback, []).append((start, trace_id, count))
    assign: dict[str, int] = {}
    outputs: list[tuple[int, int]] = []
    for attempt in sorted(by_attempt):
        index, filled = 0, 0
        outputs.append((attempt, 0))
        for _, trace_id, count in sorted(by_attempt[attempt]):
            if filled and filled + count > max_spans:
                index, filled = index + 1, 0
                outputs.append((attempt, index))
            assign[trace_id] = len(outputs) - 1
            filled += count
    return assign, outputs


def _spool(
    run_dir: Path, spool_dir: Path, assign: dict[str, int], wanted: range
) -> list[dict[str, Any]]:
    """Append the spans of outputs in ``wanted`` to their spools; returns the process headers
    (a spool line is ``<header number>\\t<span json>``)."""
    handles: dict[int, IO[bytes]] = {}
    headers: list[dict[str, Any]] = []
    numbers: dict[str, int] = {}
    try:
        for span, header in read_parts(run_dir):
            out = assign.get(span["traceID"])
            if out is None or out not in wanted:
                continue
            key = str(header.get("key"))
            if key not in numbers:
                numbers[key] = len(headers)
                headers.append(header)
            fh = handles.get(out)
            if fh is None:
                fh = handles[out] = open(spool_dir / f"{out}.jsonl", "wb")  # noqa: SIM115
            fh.write(b"%d\t" % numbers[key] + orjson.dumps(span) + b"\n")
    finally:
        for fh in handles.values():
            fh.close()
    return headers


def _spooled(path: Path, headers: list[dict[str, Any]]) -> Iterator[tuple[dict, dict]]:
    if not path.exists():
        return
    with open(path, "rb") as fh:
        for line in fh:
            number, _, body = line.partition(b"\t")
            yield orjson.loads(body), headers[int(number)]


def merge_trace_files(
    run_dir: str | Path, *, max_spans: int = 100_000, default_attempt: int | None = None
) -> list[Path]:
    """Write ``traces/run-attempt<k>.json`` (and ``-2``, ``-3``, ... past ``max_spans``).

    A trace whose spans name no attempt goes to ``default_attempt``, else to the newest
    attempt seen. Returns the files written, by attempt then order; [] when there are no
    spans. Stale extra files of a rewritten attempt are removed.
    """
    run_dir = Path(run_dir)
    out_dir = trace_dir(run_dir)
    stats = _index(run_dir)
    if not stats:
        return []
    assign, outputs = _plan(stats, max(1, max_spans), default_attempt)
    del stats
    spool_dir = out_dir / f".merge-spool-{os.getpid()}"
    shutil.rmtree(spool_dir, ignore_errors=True)
    spool_dir.mkdir(parents=True)
    written: list[Path] = []
    try:
        for first in range(0, len(outputs), MAX_OPEN_SPOOLS):
            wanted = range(first, min(first + MAX_OPEN_SPOOLS, len(outputs)))
            headers = _spool(run_dir, spool_dir, assign, wanted)
            for out in wanted:
                spool = spool_dir / f"{out}.jsonl"
                traces = build_traces(_spooled(spool, headers))
                for t in traces:
                    t.pop("_attempt", None)
                attempt, index = outputs[out]
                path = out_dir / merged_name(attempt, index)
                write_json_atomic(path, {"data": traces})
                spool.unlink(missing_ok=True)
                written.append(path)
    finally:
        shutil.rmtree(spool_dir, ignore_errors=True)
    for attempt in sorted({a for a, _ in outputs}):
        for stale in out_dir.glob(f"run-attempt{attempt}-*.json"):
            if stale not in written:
                stale.unlink(missing_ok=True)
    return written

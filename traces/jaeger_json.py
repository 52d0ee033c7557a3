"""Jaeger's own JSON trace format: span conversion, per-process part files, and the merge.

Why this layout: a run has many exporting processes (driver, controller, one per worker),
and each holds spans of the same traces. Rewriting one shared JSON document from many
processes is neither atomic nor cheap, so every process appends its spans to its own part
file (``<run_dir>/traces/parts/*.jsonl``: a header line describing the process, then one
Jaeger span per line). Appends are crash-safe in the sense that matters: a crash leaves at
most a torn last line, which readers skip. At the end of a run the driver calls
`traces.merge.merge_trace_files`, which groups all spans by trace id and writes one file
per attempt, ``traces/run-attempt<k>.json`` (split into ``run-attempt<k>-2.json``, ...
past ``max_spans``), each written to a temporary name and renamed. Those files are what a user
uploads to Jaeger UI (Search -> Upload). Part files stay, so a crashed run can be merged
later and `sft-runtime trace` reads either form.

This module needs neither the SDK nor the API: it works on plain dicts and duck-typed
spans, so the CLI can read traces without importing OpenTelemetry at all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

PARTS_DIR = "parts"
MERGED_GLOB = "run-attempt*.json"
_SAFE = re.compile(r"[^A-Za-z0-9_.]+")
_KIND_NAMES = {0: "internal", 1: "server", 2: "client", 3: "producer", 4: "consumer"}


def trace_dir(run_dir: str | Path) -> Path:
    """Where a run's Jaeger files live."""
    return Path(run_dir) / "traces"


def tag(key: str, value: Any) -> dict[str, Any]:
    """One Jaeger tag; sequences (OTel allows homogeneous lists) become a JSON string."""
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    if isinstance(value, (list, tuple)):
        return {"key": key, "type": "string", "value": orjson.dumps(list(value)).decode()}
    return {"key": key, "type": "string", "value": str(value)}


def tags(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [tag(k, v) for k, v in (attributes or {}).items()]


def tag_value(span: Mapping[str, Any], key: str) -> Any:
    """The value of a span's tag, or None."""
    for t in span.get("tags") or ():
        if t.get("key") == key:
            return t.get("value")
    return None


def span_to_jaeger(span: Any) -> dict[str, Any]:
    """A finished SDK span (anything shaped like `ReadableSpan`) as a Jaeger span dict.

    The parent becomes the first reference (``CHILD_OF``): Jaeger UI takes
    ``references[0]`` as the parent. Links follow as ``FOLLOWS_FROM``, which is how Jaeger's
    own OTLP translator maps them. Times are integer microseconds.
    """
    ctx = span.context
    trace_id = f"{ctx.trace_id:032x}"
    refs = []
    parent = span.parent
    if parent is not None and parent.is_valid:
        refs.append(
            {"refType": "CHILD_OF", "traceID": trace_id, "spanID": f"{parent.span_id:016x}"}
        )
    for link in span.links or ():
        lc = link.context
        refs.append(
            {
                "refType": "FOLLOWS_FROM",
                "traceID": f"{lc.trace_id:032x}",
                "spanID": f"{lc.span_id:016x}",
            }
        )
    span_tags = tags(span.attributes)
    scope = getattr(span, "instrumentation_scope", None)
    if scope is not None:
        span_tags.append(tag("otel.scope.name", scope.name))
    kind = getattr(getattr(span, "kind", None), "value", 0)
    if kind:
        span_tags.append(tag("span.kind", _KIND_NAMES.get(kind, str(kind))))
    status = span.status
    code = getattr(status.status_code, "name", "UNSET")
    if code != "UNSET":
        span_tags.append(tag("otel.status_code", code))
    if code == "ERROR":
        span_tags.append(tag("error", True))
        if status.description:
            span_tags.append(tag("otel.status_description", status.description))
    start_us = span.start_time // 1000
    end_us = (span.end_time or span.start_time) // 1000
    logs = [
        {
            "timestamp": event.timestamp // 1000,
            "fields": [tag("event", event.name), *tags(event.attributes)],
        }
        for event in span.events or ()
    ]
    return {
        "traceID": trace_id,
        "spanID": f"{ctx.span_id:016x}",
        "operationName": span.name,
        "references": refs,
        "startTime": start_us,
        "duration": max(0, end_us - start_us),
        "tags": span_tags,
        "logs": logs,
    }


def part_file_name(process_key: str, index: int) -> str:
    """File name of the index-th part of one process (names sort by process, then part)."""
    return f"{_SAFE.sub('-', process_key)}.{index:04d}.jsonl"


class TraceFileError(ValueError):
    """A run's trace files are missing or damaged; the message names the path."""


def scan_part_file(path: Path) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(span, process header) for each span of one part file, streamed; unreadable lines
    (a torn tail after a crash) are skipped."""
    header: dict[str, Any] = {"key": path.name, "serviceName": "unknown", "tags": []}
    with open(path, "rb") as fh:
        for line in fh:
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            if isinstance(rec.get("process"), dict):
                header = rec["process"]
            elif "spanID" in rec and "traceID" in rec:
                yield rec, header


def read_part_file(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(process header, spans) of one part file, all in memory (small files, tests)."""
    pairs = list(scan_part_file(path))
    return (pairs[0][1] if pairs else None), [span for span, _ in pairs]


def part_files(run_dir: str | Path) -> list[Path]:
    parts = trace_dir(run_dir) / PARTS_DIR
    return sorted(parts.glob("*.jsonl")) if parts.is_dir() else []


def read_parts(run_dir: str | Path) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Every (span, process header) pair of a run's part files, streamed."""
    for path in part_files(run_dir):
        yield from scan_part_file(path)


def read_jaeger_file(path: Path) -> list[dict[str, Any]]:
    """The traces of one Jaeger JSON file, checked for the fields readers rely on."""
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise TraceFileError(f"{path}: not a readable JSON file ({exc})") from exc
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise TraceFileError(f"{path}: not a Jaeger trace file (no 'data' list)")
    for i, t in enumerate(data):
        ok = isinstance(t, dict) and isinstance(t.get("spans"), list)
        ok = ok and all(isinstance(s, dict) and "spanID" in s for s in t["spans"])
        if not ok:
            raise TraceFileError(f"{path}: trace {i} has no valid 'spans' list")
    return data


def read_merged(run_dir: str | Path) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(span, process header) pairs from the merged files, one file in memory at a time."""
    for path in sorted(trace_dir(run_dir).glob(MERGED_GLOB)):
        for t in read_jaeger_file(path):
            processes = t.get("processes") or {}
            for span in t["spans"]:
                pid = span.get("processID")
                key = f"{path.name}/{t.get('traceID')}/{pid}"
                yield span, {**processes.get(pid, {}), "key": key}


def attempt_of(span: Mapping[str, Any], header: Mapping[str, Any]) -> int | None:
    """The attempt a span names (its ``attempt`` tag, else its process's), or None."""
    for value in (tag_value(span, "attempt"), header.get("attempt")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _trace_attempt(spans: Iterable[tuple[dict[str, Any], dict[str, Any]]]) -> int | None:
    """A trace belongs to the attempt its spans or processes name (the largest, if several)."""
    nums = [a for a in (attempt_of(s, h) for s, h in spans) if a is not None]
    return max(nums) if nums else None


def build_traces(
    pairs: Iterable[tuple[dict[str, Any], dict[str, Any]]],
) -> list[dict[str, Any]]:
    """Jaeger trace objects (``traceID``, ``spans``, ``processes``) from (span, process) pairs.

    Each exporting process becomes one entry ``p1``, ``p2``, ... of the trace's processes;
    spans are ordered by start time and traces by their first span. A span exported twice
    (a retried batch) is kept once.
    """
    by_trace: dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {}
    for span, header in pairs:
        by_trace.setdefault(span["traceID"], {})[span["spanID"]] = (span, header)
    traces = []
    for trace_id, members in by_trace.items():
        ordered = sorted(members.values(), key=lambda sh: sh[0].get("startTime", 0))
        ids: dict[str, str] = {}
        processes: dict[str, Any] = {}
        spans = []
        for span, header in ordered:
            key = str(header.get("key"))
            if key not in ids:
                ids[key] = f"p{len(ids) + 1}"
                processes[ids[key]] = {
                    "serviceName": header.get("serviceName", "unknown"),
                    "tags": header.get("tags", []),
                }
            spans.append({**span, "processID": ids[key]})
        traces.append(
            {
                "traceID": trace_id,
                "spans": spans,
                "processes": processes,
                "warnings": None,
                "_attempt": _trace_attempt(ordered),
            }
        )
    traces.sort(key=lambda t: t["spans"][0].get("startTime", 0))
    return traces


def write_json_atomic(path: Path, document: Any) -> None:
    """Write to a temporary sibling, fsync, rename: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(orjson.dumps(document))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def merged_name(attempt: int, index: int) -> str:
    return f"run-attempt{attempt}.json" if index == 0 else f"run-attempt{attempt}-{index + 1}.json"

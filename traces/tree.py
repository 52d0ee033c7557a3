"""Read a run's Jaeger files back and render one step's span tree as text.

`sft-runtime trace` uses this to answer "where did step N spend its time" without a Jaeger
UI. It reads the per-process part files when they exist (they are the most complete: a
crashed run has no merged file), else the merged ``run-attempt*.json`` files. Needs neither
the SDK nor a running anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sft_runtime.traces.jaeger_json import (
    MERGED_GLOB,
    TraceFileError,
    build_traces,
    part_files,
    read_merged,
    read_parts,
    tag_value,
    trace_dir,
)

STEP_OPERATION = "rl.sft_v2.step"  # traces.spans.STEP_SPAN, without importing the API here
JOB_OPERATION = "rl.sft_v2.job"  # traces.spans.JOB_SPAN
__all__ = [
    "Node",
    "TraceFileError",
    "build_tree",
    "find_job_trace",
    "find_step_trace",
    "render_tree",
    "run_spans",
]


@dataclass
class Node:
    span: dict[str, Any]
    process: dict[str, Any]
    children: list[Node] = field(default_factory=list)


Pairs = Iterator[tuple[dict[str, Any], dict[str, Any]]]


def run_spans(run_dir: str | Path) -> Callable[[], Pairs]:
    """A re-iterable source of a run's (span, process) pairs: the part files when there are
    any (the most complete: a crashed run has no merged file), else the merged files."""
    run = Path(run_dir)
    if not run.is_dir():
        what = "a file, not a run directory" if run.exists() else "no such run directory"
        raise TraceFileError(f"{run}: {what}")
    if part_files(run):
        return lambda: read_parts(run)
    tdir = trace_dir(run)
    if not (tdir.is_dir() and any(tdir.glob(MERGED_GLOB))):
        raise TraceFileError(
            f"{tdir}: no trace files (was telemetry enabled with the jaeger_file exporter?)"
        )
    return lambda: read_merged(run)


def find_step_trace(
    run_dir: str | Path, step: int | None = None
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(step span, its whole trace, how many executions of the step exist) for step N or the
    last step. A step run again after a resume has several executions; the newest wins.

    Two streaming passes (find the step span, then gather its trace), so a long run's files
    are never all in memory.
    """
    source = run_spans(run_dir)
    found: list[tuple[int, int, str, str]] = []  # (start, step, trace id, span id)
    for span, _ in source():
        if span.get("operationName") == STEP_OPERATION:
            n = tag_value(span, "step")
            if isinstance(n, int):
                found.append((span.get("startTime", 0), n, span["traceID"], span["spanID"]))
    if not found:
        raise TraceFileError(f"{trace_dir(run_dir)}: no {STEP_OPERATION} spans in the trace files")
    steps = sorted({n for _, n, _, _ in found})
    want = steps[-1] if step is None else step
    runs = sorted(f for f in found if f[1] == want)
    if not runs:
        raise TraceFileError(f"no trace for step {want} (steps traced: {steps[0]}..{steps[-1]})")
    _, _, trace_id, span_id = runs[-1]
    [trace] = build_traces(pair for pair in source() if pair[0]["traceID"] == trace_id)
    trace.pop("_attempt", None)
    span = next(s for s in trace["spans"] if s["spanID"] == span_id)
    return span, trace, len(runs)


def find_job_trace(run_dir: str | Path) -> tuple[dict[str, Any], int]:
    """(the newest attempt's job trace, how many attempts traced one): start-up, the saves
    and teardown, which the step traces link to by their ``sft.job.trace_id`` tag."""
    source = run_spans(run_dir)
    jobs = sorted(
        (span.get("startTime", 0), span["traceID"])
        for span, _ in source()
        if span.get("operationName") == JOB_OPERATION
    )
    if not jobs:
        raise TraceFileError(f"{trace_dir(run_dir)}: no {JOB_OPERATION} spans in the trace files")
    trace_id = jobs[-1][1]
    [trace] = build_traces(pair for pair in source() if pair[0]["traceID"] == trace_id)
    trace.pop("_attempt", None)
    return trace, len(jobs)


def build_tree(trace: dict[str, Any], root_id: str | None = None) -> list[Node]:
    """The span tree of a trace (children by start time); spans whose parent is absent are
    roots. With root_id, only that span's subtree."""
    processes = trace.get("processes") or {}
    nodes = {s["spanID"]: Node(s, processes.get(s.get("processID"), {})) for s in trace["spans"]}
    roots = []
    for node in sorted(nodes.values(), key=lambda n: n.span.get("startTime", 0)):
        parent = None
        for ref in node.span.get("references") or ():
            if ref.get("refType") == "CHILD_OF":
                parent = nodes.get(ref.get("spanID"))
                break
        (parent.children if parent is not None else roots).append(node)
    if root_id is not None:
        return [nodes[root_id]] if root_id in nodes else []
    return roots


def process_label(process: dict[str, Any]) -> str:
    """``worker[1]``, ``controller``: the role and rank from the process tags."""
    by_key = {t.get("key"): t.get("value") for t in process.get("tags") or ()}
    role = by_key.get("sft.role") or process.get("serviceName") or "?"
    rank = by_key.get("sft.rank")
    return f"{role}[{rank}]" if rank is not None else str(role)


def render_tree(roots: list[Node]) -> list[str]:
    """One line per span: name, duration (ms), start offset from the first root (ms), process."""
    if not roots:
        return []
    t0 = min(r.span.get("startTime", 0) for r in roots)
    lines: list[str] = []

    def walk(node: Node, prefix: str, last: bool, top: bool) -> None:
        s = node.span
        branch = "" if top else ("`- " if last else "|- ")
        err = "  ERROR" if tag_value(s, "error") is True else ""
        extra = _tag_summary(s)
        lines.append(
            f"{prefix}{branch}{s.get('operationName', '?')}  "
            f"{s.get('duration', 0) / 1000:.3f} ms  "
            f"(+{(s.get('startTime', 0) - t0) / 1000:.3f} ms)  "
            f"[{process_label(node.process)}]{extra}{err}"
        )
        child_prefix = prefix if top else prefix + ("   " if last else "|  ")
        for i, child in enumerate(node.children):
            walk(child, child_prefix, i == len(node.children) - 1, False)

    for r in roots:
        walk(r, "", True, True)
    return lines


def _tag_summary(span: dict[str, Any]) -> str:
    keys = ("step", "attempt", "loss", "valid_tokens", "rank")
    parts = []
    for k in keys:
        v = tag_value(span, k)
        if v is not None:
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return ("  " + " ".join(parts)) if parts else ""

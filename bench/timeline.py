"""Where a worker's step time goes, read from the spans a run wrote (its Jaeger file).

On a machine whose cores are all busy, the CPU rows (`bench.cpu_share`) say which process
takes the time; these say what a worker waits on within a step. Each worker runs a step as
one Ray call of two spans (`start_step`: load, begin, forward/backward; `finish_step`:
gradient all-reduce, during which the next batch is read (`read_ahead`), and the
optimizer), sent ahead so that the next is queued when one ends: the time between a step's
`finish_step` and the next `start_step` is Ray taking one reply and dispatching the next
call, a cost the plain loop does not have (the time between a step's two spans is a few
microseconds inside the call). The
plain loop times the same phases itself (`PlainLoop.step`), so each phase can be set beside
its own.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

CALLS = ("start_step", "finish_step")  # the two halves of a worker's step call
# a step's phases: the worker's span names, and what the plain loop times (`PlainLoop.step`)
PHASES = ("load", "begin_step", "forward_backward", "allreduce", "optimizer")
NESTED = ("read_ahead",)  # inside a phase (the next batch, read during the all-reduce)


def _name(span: dict) -> str:
    return span["operationName"].rsplit(".", 1)[-1]


def _spans_by_worker(trace_file: Path) -> dict[str, list[tuple[int, int, str, int]]]:
    """(start us, end us, name, step) of every worker span, per worker process, in order;
    a span's step is the one its trace's root (the controller's ``step`` span) names."""
    by_worker: dict[str, list[tuple[int, int, str, int]]] = defaultdict(list)
    for trace in json.loads(trace_file.read_text())["data"]:
        roots = [s for s in trace["spans"] if _name(s) == "step"]
        if not roots:
            continue  # setup, saves: no step of their own
        tags = {t["key"]: t["value"] for t in roots[0]["tags"]}
        step = int(tags["step"])
        for span in trace["spans"]:
            process = trace["processes"][span["processID"]]
            if "worker" not in process["serviceName"]:
                continue
            pid = next(t["value"] for t in process["tags"] if t["key"] == "process.pid")
            start = span["startTime"]
            by_worker[str(pid)].append((start, start + span["duration"], _name(span), step))
    for spans in by_worker.values():
        spans.sort()
    return by_worker


def worker_phases(run_dir: Path, first_step: int) -> dict[str, float]:
    """Median ms per step, from ``first_step`` on, of each phase of a worker's step, of the
    time between its calls (``between_calls``) and of its calls' time outside any phase
    (``call_overhead``); each the mean over the workers."""
    files = sorted((run_dir / "traces").glob("run-attempt*.json"))
    if not files:
        return {}
    per_worker = []
    for spans in _spans_by_worker(files[-1]).values():
        per_step: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        calls = [s for s in spans if s[2] in CALLS]
        for begin, end, name, step in spans:
            if name in PHASES or name in NESTED:
                per_step[step][name] += (end - begin) / 1e3
        for (_, prev_end, _, _), (begin, _, _, step) in zip(calls, calls[1:], strict=False):
            per_step[step]["between_calls"] += (begin - prev_end) / 1e3
        for begin, end, _, step in calls:
            inside = sum(
                e - b for b, e, n, s in spans if n in PHASES and s == step and begin <= b < end
            )
            per_step[step]["call_overhead"] += (end - begin - inside) / 1e3
        steady = [v for step, v in per_step.items() if step >= first_step]
        if steady:
            keys = {k for v in steady for k in v}
            per_worker.append({k: statistics.median(v.get(k, 0.0) for v in steady) for k in keys})
    keys = sorted({k for w in per_worker for k in w})
    return {k: statistics.mean(w.get(k, 0.0) for w in per_worker) for k in keys}


def plain_phases(phases: list[dict[str, float]], first_step: int) -> dict[str, float]:
    """Median ms per step, from ``first_step`` on (1-based), of the phases the plain loop's
    rank timed (`PlainLoop.step`)."""
    steady = phases[first_step - 1 :]
    if not steady:
        return {}
    return {k: statistics.median(p[k] for p in steady) * 1e3 for k in steady[0]}

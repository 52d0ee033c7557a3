"""`sft-runtime trace RUN_DIR [--step N | --job]`: a step's (or the job's) span tree from the
run's Jaeger files.

Reads ``<run_dir>/traces`` (the per-process parts, else the merged files), so it works on a
laptop, on a crashed run, and without Jaeger. ``--out FILE`` writes just that step's trace
as a Jaeger JSON file, small enough to upload to Jaeger UI even from a 100k-step run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sft_runtime.runtime.errors import UserInputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="span tree of a step (default: the last) with durations")
    p.add_argument("run_dir", type=Path)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="the step to show (default: last)")
    which.add_argument(
        "--job", action="store_true", help="the job trace: start-up, saves, teardown"
    )
    p.add_argument("--out", type=Path, default=None, help="also write the step's trace here")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    from sft_runtime.traces.jaeger_json import write_json_atomic
    from sft_runtime.traces.tree import (
        TraceFileError,
        build_tree,
        find_job_trace,
        find_step_trace,
        render_tree,
    )

    try:
        if args.job:
            trace, attempts = find_job_trace(args.run_dir)
            span, executions = None, 1
        else:
            span, trace, executions = find_step_trace(args.run_dir, args.step)
    except TraceFileError as exc:
        raise UserInputError(str(exc)) from exc
    refs = span.get("references") or () if span is not None else ()
    has_parent = any(r.get("refType") == "CHILD_OF" for r in refs)
    roots = build_tree(trace, root_id=span["spanID"] if has_parent else None)
    head = f"trace {trace['traceID']}  ({len(trace['spans'])} spans"
    if args.job and attempts > 1:
        head += f"; {attempts} attempts traced, showing the newest"
    if executions > 1:
        head += f"; step executed {executions} times, showing the newest"
    print(head + ")")
    for line in render_tree(roots):
        print(line)
    if args.out is not None:
        try:
            write_json_atomic(args.out, {"data": [trace]})
        except OSError as exc:
            raise UserInputError(f"{args.out}: cannot write ({exc})") from exc
        print(f"wrote {args.out} (Jaeger UI: Search -> Upload)")
    return 0

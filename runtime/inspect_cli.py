"""`events`, `replay` and `verify`: read a run's log without ray or torch.

These are the tools for debugging a resume: what each attempt did, the save state at any
step, and whether the log is intact and every re-executed step reproduced exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from events import compare_reexecutions, history, read_log
from events.log import log_path
from runtime.errors import UserInputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="timeline of attempts, steps, aborts and checkpoints")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--timeline", action="store_true", help="one line per record as well")
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("replay", help="the save state the log folds to (at step N)")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, default=None, help="stop after this step")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("verify", help="hash chain, lineage and divergence of re-executed steps")
    p.add_argument("run_dir", type=Path)
    p.set_defaults(func=cmd_verify)


def _reader(run_dir: Path, *, validate: bool = False):
    path = log_path(run_dir)
    if not path.parent.is_dir():
        raise UserInputError(f"{path.parent}: no such run directory")
    if not path.is_file():
        raise UserInputError(f"{path}: no event log (is this a run directory?)")
    return read_log(path, validate=validate)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def cmd_events(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    reader = _reader(args.run_dir)
    hist = history(reader)
    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=f"{reader.path} ({hist.records} records)")
    for col in ("attempt", "started (UTC)", "resumed from", "steps", "rolled back", "aborts"):
        table.add_column(col)
    table.add_column("checkpoints")
    table.add_column("ended")
    for att in hist.attempts:
        steps = f"{att.first_step}-{att.last_step} ({att.steps})" if att.steps else "0"
        table.add_row(
            str(att.number),
            _when(att.started),
            "-" if att.resumed_from_step is None else str(att.resumed_from_step),
            steps,
            str(att.rolled_back),
            str(len(att.aborts)),
            ", ".join(map(str, att.checkpoints)) or "-",
            att.outcome + (f": {att.stop_error}" if att.stop_error else ""),
        )
    console.print(table)
    for att in hist.attempts:
        for abort in att.aborts:
            console.print(
                f"attempt {att.number} aborted step {abort['step']} in {abort['phase']}: "
                f"{abort['error_type']}: {abort['error']}",
                markup=False,
            )
        if att.repaired_bytes:
            console.print(f"attempt {att.number} cut a torn tail of {att.repaired_bytes} bytes")
    if reader.torn_bytes:
        console.print(f"torn last line: {reader.torn_bytes} bytes (cut off on the next resume)")
    if args.timeline:
        for rec in reader:
            step = rec.data.get("step", "")
            extra = ""
            if rec.type == "step_committed":
                extra = f"loss={rec.data['loss']:.6g} trace={rec.data.get('trace_id') or '-'}"
            elif rec.type == "run_stopped":
                extra = rec.data["reason"]
            print(
                f"{rec.seq:>8} {_when(rec.time)} a{rec.attempt} {rec.type:<17}{step!s:>8} {extra}"
            )
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from states import replay

    reader = _reader(args.run_dir)
    try:
        state = replay(reader, until_step=args.step)
    except ValueError as exc:
        raise UserInputError(f"{reader.path}: {exc}") from None
    if args.json:
        print(json.dumps(state.to_dict(), sort_keys=True))
    else:
        for key, value in state.to_dict().items():
            print(f"{key:<20} {value}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from states import replay

    reader = _reader(args.run_dir, validate=True)
    state = replay(reader)  # chain, payload schemas, lineage and the fold, line by line
    print(f"{reader.path}: chain intact, {reader.state.lines} records, lineage consistent")
    print(f"save state: {json.dumps(state.to_dict(), sort_keys=True)}")
    if reader.torn_bytes:
        print(f"warning: torn last line of {reader.torn_bytes} bytes (cut off on the next resume)")
    compared, found = compare_reexecutions(reader)
    if found:
        print(
            f"DIVERGED: {compared} re-executed steps compared, {len(found)} differ", file=sys.stderr
        )
        print(f"first divergence: {found[0].describe()}", file=sys.stderr)
        return 1
    print(f"re-executed steps compared: {compared}, divergent: 0")
    return 0

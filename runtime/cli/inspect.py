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

from sft_runtime.events import compare_reexecutions, history, read_log, records_in_effect
from sft_runtime.events.log import log_path
from sft_runtime.events.schemas import as_float
from sft_runtime.events.shards import check_shards
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.launch.run_dirs import require_run_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="timeline of attempts, steps, aborts and checkpoints")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--timeline", action="store_true", help="one line per record as well")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="also draw loss, lr and tokens/s per step with attempts, resumes, aborts and "
        "checkpoints marked (needs the plot extra)",
    )
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("replay", help="the save state the log folds to (at step N)")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, default=None, help="stop after this step")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("verify", help="hash chain, lineage, checkpoints, divergence of re-runs")
    p.add_argument("run_dir", type=Path)
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="look for the checkpoints here (default: where the log records them)",
    )
    p.add_argument(
        "--log-only",
        action="store_true",
        help="check the log alone, not its checkpoints (a log copied without them)",
    )
    p.set_defaults(func=cmd_verify)


def _reader(run_dir: Path, *, validate: bool = False):
    path = log_path(run_dir)
    require_run_dir(path.parent)  # RUN_DIR, or the folder of the events file given
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

    if args.plot is not None:  # refused before the log is read
        from sft_runtime.runtime.cli import plot

        plot.require_matplotlib()
        plot.check_output(args.plot)
    reader = _reader(args.run_dir)
    hist = history(reader)
    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=f"{reader.path} ({hist.records} records)")
    for col in ("attempt", "started (UTC)", "resumed from", "steps", "rolled back", "aborts"):
        table.add_column(col)
    table.add_column("checkpoints")
    if any(att.validations for att in hist.attempts):
        table.add_column("validated")
    table.add_column("ended")
    validated = any(att.validations for att in hist.attempts)
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
            *([", ".join(map(str, att.validations)) or "-"] if validated else []),
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
        for line in config_notes(att):
            console.print(line, markup=False)
    if reader.torn_bytes:
        console.print(f"torn last line: {reader.torn_bytes} bytes (cut off on the next resume)")
    if args.timeline:
        for rec in reader:
            step = rec.data.get("step", "")
            extra = ""
            if rec.type == "step_committed":
                loss, trace_id = as_float(rec.data["loss"]), rec.data.get("trace_id") or "-"
                extra = f"loss={loss:.6g} trace={trace_id}"
            elif rec.type == "step_aborted":
                extra = (
                    f"{rec.data['phase']}: {rec.data['error_type']} "
                    f"trace={rec.data.get('trace_id') or '-'}"
                )
            elif rec.type == "run_stopped":
                extra = rec.data["reason"]
            elif rec.type == "placement_changed":
                data = rec.data
                extra = (
                    f"workers {data['old_world_size']} -> {data['new_world_size']}, "
                    f"shards per worker {data['shard_map']}"
                )
            print(
                f"{rec.seq:>8} {_when(rec.time)} a{rec.attempt} {rec.type:<17}{step!s:>8} {extra}"
            )
    if args.plot is not None:
        count = len(hist.attempts)
        title = f"{args.run_dir} ({count} attempt{'' if count == 1 else 's'})"
        print(f"plot: {plot.write_plot(reader, args.plot, title=title)}")
    return 0


def config_notes(att) -> list[str]:
    """What an attempt's run_started says it changed: config keys that decide a step (the
    steps it ran are not expected to match the checkpoint's run) and a fresh optimizer."""
    notes = []
    if att.workers_changed is not None:
        old, new = att.workers_changed
        notes.append(
            f"attempt {att.number} resumed from step {att.resumed_from_step} on {new} "
            f"data-parallel worker(s) (was {old}): the same data shards, dealt "
            f"{att.shard_map}"
        )
    if att.config_changes:
        shown = "; ".join(
            f"{key}: {json.dumps(old)} -> {json.dumps(new)}"
            for key, (old, new) in att.config_changes.items()
        )
        notes.append(
            f"attempt {att.number} resumed from step {att.resumed_from_step} with a changed "
            f"config ({att.config_digest}): {shown}"
        )
    if att.optimizer_restored is False:
        notes.append(
            f"attempt {att.number}: step_{att.resumed_from_step} held no optimizer state, "
            "AdamW started fresh"
        )
    return notes


def cmd_replay(args: argparse.Namespace) -> int:
    from sft_runtime.states import replay

    reader = _reader(args.run_dir)
    try:
        state = replay(reader, until_step=args.step)
    except ValueError as exc:
        raise UserInputError(f"{reader.path}: {exc}") from None
    shown: dict = state.to_dict()
    last = _last_validation(reader, state.total_steps)
    if last is not None:  # what a checkpoint here is ranked by with a val: metric
        shown["last_validation"] = last
    if args.json:
        print(json.dumps(shown, sort_keys=True))
    else:
        for key, value in shown.items():
            print(f"{key:<20} {value}")
    return 0


def _last_validation(reader, until_step: int) -> dict | None:
    last = None
    for rec in records_in_effect(reader):
        if rec.type == "validation_completed" and rec.data["step"] <= until_step:
            last = {"step": rec.data["step"], "val_loss": as_float(rec.data["loss"])}
    return last


def cmd_verify(args: argparse.Namespace) -> int:
    from sft_runtime.events.snapshot import LogSnapshot
    from sft_runtime.states import replay

    # every pass reads the same lines, however much a live run appends meanwhile
    reader = LogSnapshot(_reader(args.run_dir).path, validate=True)
    state = replay(reader)  # chain, payload schemas, lineage and the fold, line by line
    print(f"{reader.path}: chain intact, {reader.state.lines} records, lineage consistent")
    print(f"save state: {json.dumps(state.to_dict(), sort_keys=True)}")
    if reader.torn_bytes:
        print(f"warning: torn last line of {reader.torn_bytes} bytes (cut off on the next resume)")
    problems: list[str] = []
    if args.log_only:
        print("checkpoints: not checked (--log-only)")
    else:
        from sft_runtime.runtime.debug.verify_checkpoints import check_checkpoints

        report = check_checkpoints(args.run_dir, reader, checkpoint_dir=args.checkpoint_dir)
        for line in report.lines():
            print(line)
        problems = report.problems
    for problem in problems:
        print(f"CHECKPOINT: {problem}", file=sys.stderr)
    shards = check_shards(reader)
    for line in shards.lines():
        print(line)
    for problem in shards.problems:
        print(f"SHARDS: {problem}", file=sys.stderr)
    for att in history(reader).attempts:  # steps of other configs are not compared
        for line in config_notes(att):
            print(line)
    compared, found = compare_reexecutions(reader)
    if found:
        print(
            f"DIVERGED: {compared} re-executed steps compared, {len(found)} differ", file=sys.stderr
        )
        print(f"first divergence: {found[0].describe()}", file=sys.stderr)
    else:
        print(f"re-executed steps compared: {compared}, divergent: 0")
    return 1 if problems or shards.problems or found else 0

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
from sft_runtime.runtime.errors import UserInputError


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
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="default: RUN_DIR/checkpoints")
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
    if reader.torn_bytes:
        console.print(f"torn last line: {reader.torn_bytes} bytes (cut off on the next resume)")
    if args.timeline:
        for rec in reader:
            step = rec.data.get("step", "")
            extra = ""
            if rec.type == "step_committed":
                extra = f"loss={rec.data['loss']:.6g} trace={rec.data.get('trace_id') or '-'}"
            elif rec.type == "step_aborted":
                extra = (
                    f"{rec.data['phase']}: {rec.data['error_type']} "
                    f"trace={rec.data.get('trace_id') or '-'}"
                )
            elif rec.type == "run_stopped":
                extra = rec.data["reason"]
            print(
                f"{rec.seq:>8} {_when(rec.time)} a{rec.attempt} {rec.type:<17}{step!s:>8} {extra}"
            )
    if args.plot is not None:
        count = len(hist.attempts)
        title = f"{args.run_dir} ({count} attempt{'' if count == 1 else 's'})"
        print(f"plot: {plot.write_plot(reader, args.plot, title=title)}")
    return 0


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
            last = {"step": rec.data["step"], "val_loss": rec.data["loss"]}
    return last


def _check_checkpoints(reader, root: Path) -> list[str]:
    """Every checkpoint the log still counts must exist and hold the save state replay gives."""
    from sft_runtime.runtime.checkpoint.store import CheckpointDir
    from sft_runtime.states import replay

    if not root.is_dir():
        print(f"no checkpoint directory at {root}: agreement with checkpoints not checked")
        return []
    ckpt = CheckpointDir(root)
    on_disk = set(ckpt.steps())
    in_effect = sorted(
        {r.data["step"] for r in records_in_effect(reader) if r.type == "checkpoint_saved"}
    )
    problems, agreed = [], []
    for step in in_effect:
        if step not in on_disk:
            continue  # pruned by retention (only the newest is always kept)
        try:
            saved = ckpt.info(step).get("save_state", {})
        except UserInputError as exc:
            problems.append(str(exc))
            continue
        folded = replay(reader, until_step=step).to_dict()
        if saved != folded:
            problems.append(
                f"{ckpt.path(step)}: save state {saved} but the log replays to {folded}"
            )
        else:
            agreed.append(step)
    if in_effect and in_effect[-1] not in on_disk:
        problems.append(f"the newest checkpoint the log records, step {in_effect[-1]}, is missing")
    print(f"checkpoints agree: {agreed}")
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    from sft_runtime.states import replay

    reader = _reader(args.run_dir, validate=True)
    state = replay(reader)  # chain, payload schemas, lineage and the fold, line by line
    print(f"{reader.path}: chain intact, {reader.state.lines} records, lineage consistent")
    print(f"save state: {json.dumps(state.to_dict(), sort_keys=True)}")
    if reader.torn_bytes:
        print(f"warning: torn last line of {reader.torn_bytes} bytes (cut off on the next resume)")
    problems = _check_checkpoints(reader, args.checkpoint_dir or args.run_dir / "checkpoints")
    for problem in problems:
        print(f"CHECKPOINT: {problem}", file=sys.stderr)
    compared, found = compare_reexecutions(reader)
    if problems:
        return 1
    if found:
        print(
            f"DIVERGED: {compared} re-executed steps compared, {len(found)} differ", file=sys.stderr
        )
        print(f"first divergence: {found[0].describe()}", file=sys.stderr)
        return 1
    print(f"re-executed steps compared: {compared}, divergent: 0")
    return 0

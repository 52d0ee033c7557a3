"""`verify`'s checkpoint check: every checkpoint the log records is there and agrees with it.

The checkpoints are the ones the log records (`checkpoint.recorded`), wherever the run put
them. Each one on disk must hold, in its ``training_info.json``, the save state the log
replays to at its step. One that is gone (or half gone: a prune deletes a folder file by
file, training_info.json perhaps first) is missing, unless the run's own retention rules
removed it: pruning writes no record, so it is decided from the rules themselves
(``checkpointing.save_period``, ``keep_top_k``, ``ft_keep_latest_k``, ``higher_is_better``
from the newest checkpoint's ``config.yaml``, applied by `store.retained_steps` to every
step the log saw saved, ranked by the metric each ``checkpoint_saved`` records). What the
rules keep at the end they kept all along, so a checkpoint they keep and that is gone was
removed by something else. With no readable ``config.yaml`` the rules are unknown, and only
the newest checkpoint, which every rule keeps, must be there.

On a run that is still training, the log grows and checkpoints come and go while this
runs. The check reads one snapshot of the log (`events.snapshot.LogSnapshot`) and looks
only at the checkpoints recorded in it; the run prunes only after recording the checkpoint
that made a prune due, so when one of them is gone, a fresh snapshot holds every newer
checkpoint, and the rules applied to it tell whether it was pruned since.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sft_runtime.events.log import LOCK_NAME, LogReader, lock_holder
from sft_runtime.events.schemas import Record
from sft_runtime.events.snapshot import LogSnapshot
from sft_runtime.runtime.checkpoint.recorded import RecordedCheckpoint, recorded_checkpoints
from sft_runtime.runtime.checkpoint.store import (
    INFO_NAME,
    CheckpointDir,
    _usable_metric,
    retained_steps,
)
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.process.liveness import pid_alive
from sft_runtime.states import replay

RULE_KEYS = ("save_period", "keep_top_k", "ft_keep_latest_k", "higher_is_better")
Log = LogReader | Sequence[Record]  # read more than once


@dataclass
class CheckpointReport:
    """What `check_checkpoints` found; ``problems`` make `verify` fail."""

    agreed: list[int] = field(default_factory=list)
    pruned: list[int] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)  # gone, with the rules unknown
    problems: list[str] = field(default_factory=list)
    rules: dict[str, Any] | None = None  # the retention rules applied (None: unknown)
    live: str | None = None  # who writes the run now, when a live writer was seen

    def lines(self) -> list[str]:
        """What `verify` prints on stdout."""
        out = [f"checkpoints agree: {self.agreed}"]
        if self.pruned:
            rules = ", ".join(f"{k}={v}" for k, v in (self.rules or {}).items())
            out.append(f"pruned by retention: {self.pruned} (checkpointing: {rules})")
        if self.unknown:
            out.append(
                f"gone: {self.unknown}, and no checkpoint's config.yaml tells the retention "
                "rules: only the newest checkpoint must be there"
            )
        if self.live:
            out.append(f"live run ({self.live}): checked the checkpoints its log recorded so far")
        return out


def check_checkpoints(
    run_dir: Path | str,
    log: Log,
    *,
    checkpoint_dir: Path | str | None = None,
    reread: Callable[[], Log] | None = None,
) -> CheckpointReport:
    """Check the checkpoints ``log`` (a snapshot of the run's log) records. ``reread`` gives
    a fresh snapshot (default: `LogSnapshot` of the run's log), read only when a recorded
    checkpoint is gone (or its training_info.json is) that the rules applied to ``log``
    keep."""
    run_dir = Path(run_dir)
    if checkpoint_dir is not None and not Path(checkpoint_dir).is_dir():
        raise UserInputError(f"--checkpoint-dir {checkpoint_dir}: no such folder")
    recorded = recorded_checkpoints(log, run_dir, checkpoint_dir=checkpoint_dir)
    report = CheckpointReport(live=live_writer(run_dir))
    # gone, or half gone (a prune deletes a folder file by file): a problem unless pruned
    doubtful: dict[int, tuple[RecordedCheckpoint, str | None]] = {}
    for ckpt in recorded:
        info = _read_info(ckpt)
        if not isinstance(info, dict):
            doubtful[ckpt.step] = (ckpt, info)
            continue
        problem = _disagreement(ckpt, info, log)
        if problem is None:
            report.agreed.append(ckpt.step)
        else:
            report.problems.append(problem)
    if not doubtful:
        return report
    report.rules = retention_rules(recorded)
    kept = _kept(report.rules, log, recorded) & doubtful.keys()
    if kept:  # newer checkpoints may have been saved, and these pruned, since `log`
        fresh = reread() if reread is not None else LogSnapshot(run_dir / "events.jsonl")
        now = recorded_checkpoints(fresh, run_dir, checkpoint_dir=checkpoint_dir)
        report.rules = retention_rules(now) or report.rules
        kept &= _kept(report.rules, fresh, now) & {c.step for c in now}
    left = [step for step in doubtful if step not in kept]
    if report.rules is None:
        report.unknown = left
    else:
        report.pruned = left
    why = "the retention rules keep it" if report.rules else "it is the newest the log records"
    for step in sorted(kept):
        ckpt, unreadable = doubtful[step]
        if unreadable is None or not ckpt.exists:
            unreadable = (
                f"{ckpt.folder}: missing; the log records it (line {ckpt.line}, "
                f"checkpoint_saved of step {step}) and {why}"
            )
        report.problems.append(unreadable)
    return report


def _read_info(ckpt: RecordedCheckpoint) -> dict | str | None:
    """The checkpoint's training_info.json; None when its folder is gone; else why it
    cannot be read."""
    info_path = ckpt.folder / INFO_NAME
    try:
        info = json.loads(info_path.read_text())
    except FileNotFoundError:
        return None if not ckpt.exists else f"{info_path}: missing; the checkpoint is incomplete"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None if not ckpt.exists else f"{info_path}: unreadable ({exc})"
    return info if isinstance(info, dict) else f"{info_path}: not a JSON object"


def _disagreement(ckpt: RecordedCheckpoint, info: dict, log: Log) -> str | None:
    """None when ``info`` holds the save state the log replays to at the checkpoint's step;
    else what differs."""
    saved = info.get("save_state", {})
    folded = replay(log, until_step=ckpt.step).to_dict()
    if saved != folded:
        return f"{ckpt.folder}: save state {saved} but the log replays to {folded}"
    return None


def retention_rules(recorded: Sequence[RecordedCheckpoint]) -> dict[str, Any] | None:
    """The ``checkpointing`` retention keys of the newest recorded checkpoint that has a
    readable ``config.yaml`` (the defaults for keys it leaves out); None when none has."""
    from sft_runtime.runtime.checkpoint.config import CheckpointingConfig

    defaults = CheckpointingConfig()
    for ckpt in reversed(recorded):
        try:
            raw = yaml.safe_load((ckpt.folder / "config.yaml").read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # not there (pruned meanwhile, say): an older one says the same
        section = raw.get("checkpointing") if isinstance(raw, dict) else None
        section = section if isinstance(section, dict) else {}
        return {key: section.get(key, getattr(defaults, key)) for key in RULE_KEYS}
    return None


def _kept(
    rules: dict[str, Any] | None, log: Log, recorded: Sequence[RecordedCheckpoint]
) -> set[int]:
    """The recorded steps the retention rules keep, among every step the log saw saved (in
    effect or rolled back: the run pruned among all of them) and every one on disk."""
    if not recorded:
        return set()
    if rules is None:
        return {recorded[-1].step}  # every rule keeps the newest
    metrics: dict[int, float | None] = {}  # ranked as the run ranked them (NaN: unranked)
    for rec in log:
        if rec.type == "checkpoint_saved":
            metrics[rec.data["step"]] = _usable_metric(rec.data)
    for ckpt in recorded:
        metrics[ckpt.step] = _usable_metric({"metric": ckpt.metric})  # the record in effect
    roots = {c.folder.parent for c in recorded}
    steps = set(metrics).union(*(CheckpointDir(root).steps() for root in roots))
    return retained_steps(
        steps,
        metrics,
        int(rules["save_period"] or 0),
        rules["keep_top_k"],
        rules["ft_keep_latest_k"],
        bool(rules["higher_is_better"]),
    )


def live_writer(run_dir: Path) -> str | None:
    """``pid P on HOST`` when the run's lock names a process that still runs on this host: a
    run that is training now. Read from the lock file only: taking the lock, even for an
    instant, could refuse the run that wants it at that instant."""
    import socket

    holder = lock_holder(run_dir / LOCK_NAME)
    pid, host = holder.get("pid"), holder.get("host")
    if not isinstance(pid, int) or host != socket.gethostname() or not pid_alive(pid):
        return None
    return f"pid {pid} on {host}"

"""Where a re-run of step N begins: the newest checkpoint before N that both vouch for.

A checkpoint counts when the log still holds its ``checkpoint_saved`` (not rolled back by a
later resume) and its directory is on disk, which is the rule a resume follows; the
directory is the one the record names (`checkpoint.recorded`), wherever the run put it.
Reading only, so the run directory is never touched: no lock, no repair of a torn tail, no
pruning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sft_runtime.events import read_log, records_in_effect
from sft_runtime.events.log import LogReader, log_path
from sft_runtime.events.run_diff import StepFacts, step_facts
from sft_runtime.runtime.checkpoint.recorded import checkpoint_store, recorded_checkpoints
from sft_runtime.runtime.checkpoint.store import CheckpointDir
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.launch.run_dirs import require_run_dir


@dataclass(frozen=True)
class StartPoint:
    """Steps ``checkpoint + 1 .. until`` are re-run; ``step`` is the one asked about."""

    run_dir: Path
    step: int
    until: int
    checkpoint: int
    checkpoints: CheckpointDir
    checkpoint_line: int  # 1-based line of the checkpoint_saved record in effect
    facts: dict[int, StepFacts]  # every committed step in effect, as the log has it
    # from the run's start (``checkpoint`` 0): the checkpoint whose config.yaml is read
    config_checkpoint: int | None = None

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoints.path(self.checkpoint)

    @property
    def config_path(self) -> Path:
        """The config.yaml the re-run is built from."""
        held = self.checkpoint if self.config_checkpoint is None else self.config_checkpoint
        return self.checkpoints.path(held) / "config.yaml"

    @property
    def origin(self) -> str:
        """Where the re-run starts, in words."""
        if self.checkpoint == 0:
            return f"the run's start (config from {self.config_path})"
        return str(self.checkpoint_path)

    @property
    def log(self) -> Path:
        return log_path(self.run_dir)

    @property
    def steps(self) -> range:
        return range(self.checkpoint + 1, self.until + 1)

    def reader(self) -> LogReader:
        return read_log(self.log, validate=True)


def open_run_log(run_dir: Path) -> LogReader:
    """The run's log, read with every payload checked (a damaged line names itself)."""
    path = log_path(require_run_dir(run_dir))
    if not path.is_file():
        raise UserInputError(f"{path}: no event log (is this a run directory?)")
    return read_log(path, validate=True)


def find_start(
    run_dir: Path | str,
    step: int,
    *,
    until: int | None = None,
    checkpoint_dir: Path | str | None = None,
    from_run_start: bool = False,
) -> StartPoint:
    """The start point of a re-run of steps up to ``until`` (default ``step``); bad input
    (a step the log does not hold, no checkpoint before ``step``) raises `UserInputError`.

    ``from_run_start``: with no checkpoint before ``step``, start from the run's start,
    which is as deterministic as a checkpoint for what needs no weights (the loaders), its
    config read from the oldest checkpoint on disk (the log's digests then prove each
    batch read, so a config that changed since shows as a mismatch, never as an answer).
    """
    run_dir = Path(run_dir)
    reader = open_run_log(run_dir)
    facts = step_facts(reader)
    saved_at = {
        rec.data["step"]: rec.line
        for rec in records_in_effect(reader)
        if rec.type == "checkpoint_saved"
    }
    until = step if until is None else until
    if step < 1:
        raise UserInputError(f"--step must be at least 1, got {step}")
    if until < step:
        raise UserInputError(f"--to {until} must not be before --step {step}")
    last = max(facts, default=0)
    for asked in (step, until):
        if asked > last:
            held = f"commits steps 1..{last}" if last else "commits no step"
            raise UserInputError(f"step {asked} is beyond the log: {reader.path} {held}")
    # wherever the run saved them (checkpointing.checkpoint_dir), or under --checkpoint-dir
    recorded = recorded_checkpoints(reader, run_dir, checkpoint_dir=checkpoint_dir)
    usable = [c for c in recorded if c.exists and c.step < step]
    on_disk = [c for c in recorded if c.exists]
    if not usable and from_run_start and on_disk:
        start = _fresh_start_line(reader)
        checkpoints = CheckpointDir(on_disk[0].folder.parent)
        return StartPoint(run_dir, step, until, 0, checkpoints, start, facts, on_disk[0].step)
    if not usable:
        on_disk = [c.step for c in recorded if c.exists]
        where = checkpoint_store(run_dir, reader, checkpoint_dir=checkpoint_dir).root
        raise UserInputError(
            f"no checkpoint before step {step}: the log records checkpoints "
            f"{sorted(saved_at)} and {where} holds {on_disk}"
        )
    k = usable[-1]
    checkpoints = CheckpointDir(k.folder.parent)
    return StartPoint(run_dir, step, until, k.step, checkpoints, saved_at[k.step], facts)


def _fresh_start_line(reader: LogReader) -> int:
    """The line of the ``run_started`` in effect that began from scratch (the last one:
    a run that failed before its first checkpoint starts from scratch again)."""
    fresh = [
        rec.line
        for rec in records_in_effect(reader)
        if rec.type == "run_started" and rec.data.get("resumed_from_step") is None
    ]
    if not fresh:
        raise UserInputError(f"{reader.path}: no run_started record in effect")
    return fresh[-1]

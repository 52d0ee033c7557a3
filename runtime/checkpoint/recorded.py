"""The checkpoint folders a run's log records, found wherever the run put them.

Every tool that reads a run's checkpoints (`verify`, `export`, `samples`, `reproduce`,
`diff`) finds them here, from the ``checkpoint_saved`` records of ``events.jsonl``, which
is always in the run directory: the checkpoints need not be (``checkpointing.checkpoint_dir``
elsewhere, as NeMo RL configs set it), and a tool that guessed ``RUN_DIR/checkpoints``
looked in the wrong place.

``checkpoint_saved.path`` is written by `record_path`: relative to the run directory when
the folder lies inside it (``checkpoints/step_3``), absolute otherwise. Logs written before
that hold the path as the run was given it (absolute, or relative to where the run was
launched). A folder is looked for relative to the run directory first, so a run directory
that was moved or copied is followed to its own checkpoints and never to the ones it was
copied from; then where the log says. Reading only: nothing here writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sft_runtime.events import records_in_effect
from sft_runtime.events.lineage import LogLike
from sft_runtime.events.log import log_path, read_log
from sft_runtime.runtime.checkpoint.store import CheckpointDir

DEFAULT_FOLDER = "checkpoints"  # RUN_DIR/checkpoints without checkpointing.checkpoint_dir


@dataclass(frozen=True)
class RecordedCheckpoint:
    """A ``checkpoint_saved`` in effect and the folder it names."""

    step: int
    folder: Path  # where it is, or (when it is nowhere) where the log says it is
    recorded: str  # checkpoint_saved.path as written
    line: int  # 1-based line of the record
    metric: float | None  # what the retention rules rank it by

    @property
    def exists(self) -> bool:
        return self.folder.is_dir()


def record_path(folder: Path | str, run_dir: Path | str | None) -> Path:
    """How ``checkpoint_saved`` records ``folder``: relative to ``run_dir`` when inside it
    (the run directory can then be moved with its checkpoints), else absolute."""
    folder = Path(os.path.abspath(folder))
    if run_dir is None:
        return folder
    try:
        return folder.relative_to(os.path.abspath(run_dir))
    except ValueError:
        return folder


def checkpoint_folder(
    recorded: str, step: int, run_dir: Path | str, checkpoint_dir: Path | str | None = None
) -> Path:
    """The folder of a recorded checkpoint: under ``checkpoint_dir`` when one is given (a
    tool's ``--checkpoint-dir``), else the first that exists of: the recorded path under the
    run directory; for a path that ends in ``checkpoints/step_N`` (the default layout, as
    older logs recorded it: absolute, or relative to where the run was launched),
    ``RUN_DIR/checkpoints/step_N`` (the run directory was moved); the recorded path itself.
    None existing: where the log says."""
    if checkpoint_dir is not None:
        return Path(checkpoint_dir) / f"step_{step}"
    run_dir, path = Path(run_dir), Path(recorded)
    inside = [] if path.is_absolute() else [run_dir / path]
    default = [run_dir / DEFAULT_FOLDER / path.name] if path.parent.name == DEFAULT_FOLDER else []
    candidates = [*inside, *default, path]
    return next((c for c in candidates if c.is_dir()), inside[0] if inside else path)


def recorded_checkpoints(
    log: LogLike, run_dir: Path | str, *, checkpoint_dir: Path | str | None = None
) -> list[RecordedCheckpoint]:
    """The checkpoints the log records and still counts (not rolled back), oldest first."""
    found: dict[int, RecordedCheckpoint] = {}
    for rec in records_in_effect(log):
        if rec.type == "checkpoint_saved":
            step, recorded = rec.data["step"], rec.data["path"]
            found[step] = RecordedCheckpoint(
                step,
                checkpoint_folder(recorded, step, run_dir, checkpoint_dir),
                recorded,
                rec.line,
                rec.data.get("metric"),
            )
    return [found[step] for step in sorted(found)]


def checkpoint_store(
    run_dir: Path | str, log: LogLike | None = None, *, checkpoint_dir: Path | str | None = None
) -> CheckpointDir:
    """The folder a tool takes a run's checkpoints from: ``checkpoint_dir`` when given, else
    the one holding the newest recorded checkpoint on disk (else where the newest was
    recorded); ``RUN_DIR/checkpoints`` for a run whose log records none, or has no log."""
    if checkpoint_dir is not None:
        return CheckpointDir(checkpoint_dir)
    run_dir = Path(run_dir)
    if log is None:
        if not log_path(run_dir).is_file():
            return CheckpointDir(run_dir / DEFAULT_FOLDER)
        log = read_log(run_dir)
    recorded = recorded_checkpoints(log, run_dir)
    if not recorded:
        return CheckpointDir(run_dir / DEFAULT_FOLDER)
    newest = next((c for c in reversed(recorded) if c.exists), recorded[-1])
    return CheckpointDir(newest.folder.parent)

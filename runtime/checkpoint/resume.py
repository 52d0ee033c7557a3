"""Where a run resumes: the newest checkpoint that both the disk and the log vouch for.

The log is the record of truth and the checkpoint is a snapshot of it: the save state
replayed from ``events.jsonl`` up to step K must equal the one in ``step_K``'s
training_info.json, or the resume stops and shows both. Checkpoints the log no longer
counts (rolled back by an earlier resume) are never used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sft_runtime.events import read_log, records_in_effect
from sft_runtime.events.log import log_path
from sft_runtime.runtime.checkpoint.layout import check_layout
from sft_runtime.runtime.checkpoint.loader_states import loader_state_blobs
from sft_runtime.runtime.checkpoint.store import LOADERS_NAME, CheckpointDir
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.states import SFTV2SaveState, replay


@dataclass(frozen=True)
class ResumePoint:
    """step 0 means a fresh start."""

    step: int = 0
    save_state: SFTV2SaveState | None = None
    loader_states: list | None = None
    policy_dir: Path | None = None


def find_resume_point(run_dir: Path | str, ckpt: CheckpointDir) -> ResumePoint:
    ckpt.remove_stale()
    on_disk = ckpt.steps()
    path = log_path(run_dir)
    if not path.is_file():
        if on_disk:
            raise UserInputError(
                f"{ckpt.root} holds checkpoints {on_disk} but {path} does not exist: "
                "point the run directory at the run that wrote them"
            )
        return ResumePoint()
    reader = read_log(path)
    in_effect = [r.data["step"] for r in records_in_effect(reader) if r.type == "checkpoint_saved"]
    usable = sorted(set(in_effect) & set(on_disk))
    if not usable:
        if in_effect:
            raise UserInputError(
                f"{path} records checkpoints {sorted(set(in_effect))} but none of them is in "
                f"{ckpt.root}; restore them or start a new run directory"
            )
        return ResumePoint()
    step = usable[-1]
    return ResumePoint(step, *check_checkpoint(reader, ckpt, step))


def check_checkpoint(reader, ckpt: CheckpointDir, step: int) -> tuple[SFTV2SaveState, list, Path]:
    """The checkpoint's save state, loader states and policy dir, if it agrees with the log
    and its files are laid out as its own config.yaml says (`layout.check_layout`)."""
    info = ckpt.info(step)
    where = ckpt.path(step)
    try:
        saved = SFTV2SaveState.from_dict(info["save_state"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserInputError(f"{where}/training_info.json: no valid save_state ({exc})") from None
    folded = replay(reader, until_step=step)
    fields = ("total_steps", "consumed_samples", "total_valid_tokens")
    if any(getattr(saved, f) != getattr(folded, f) for f in fields):
        show = ", ".join(f"{f}={getattr(saved, f)} vs {getattr(folded, f)}" for f in fields)
        raise UserInputError(
            f"{where} disagrees with {reader.path} replayed to step {step} "
            f"(checkpoint vs log: {show})"
        )
    loaders = where / LOADERS_NAME
    if not loaders.is_file():
        raise UserInputError(f"{loaders}: missing; the checkpoint has no loader states")
    try:
        states = loader_state_blobs(loaders.read_bytes())
    except UserInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file is bad input
        raise UserInputError(f"{loaders}: unreadable loader states ({exc})") from None
    check_layout(where)  # weights and optimizer as its config.yaml wrote them, read safely
    return saved, states, where / "policy"

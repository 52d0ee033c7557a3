"""Writes realistic run logs for tests: attempts that commit steps, save, crash and resume."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from sft_runtime.events import (
    CheckpointSaved,
    EventLog,
    LoadersReady,
    RunStarted,
    RunStopped,
    StepAborted,
    StepCommitted,
    open_log,
)

PLACEMENT = "a" * 64


def sample_digest(step: int, rank: int, salt: str = "") -> str:
    return hashlib.sha256(f"{step}:{rank}:{salt}".encode()).hexdigest()[:16]


def step_event(step: int, *, ranks: int = 2, salt: str = "", loss: float | None = None):
    return StepCommitted(
        step=step,
        source_samples=8,
        valid_tokens=100 + step,
        physical_packs=8,
        loss=loss if loss is not None else 1.0 / step,
        grad_norm=0.5,
        lr=1e-3,
        timings={"total_step_time": 0.01},
        sample_digests=[sample_digest(step, r, salt) for r in range(ranks)],
        trace_id=f"{step:032x}",
        span_id=f"{step:016x}",
    )


@dataclass
class Attempt:
    """One launch: resume from ``resume`` (None = fresh), commit up to ``until``."""

    until: int
    resume: int | None = None
    save_every: int = 0
    stop: str | None = "completed"  # None: the process "crashes" (no run_stopped)
    abort_at: int | None = None  # append a step_aborted before this step
    salt: str = ""  # change the samples of re-executed steps (plants a divergence)
    loss_bump: int | None = None  # step whose loss differs from the first execution


def run_attempt(log: EventLog, att: Attempt, totals: list[int]) -> None:
    """Append one attempt; ``totals`` is [steps, samples, tokens] at the resume point."""
    log.append(RunStarted(placement_hash=PLACEMENT, resumed_from_step=att.resume, max_steps=99))
    log.append(LoadersReady(owner_ranks=[0, 1], logical_world_size=2, restored=bool(att.resume)))
    for step in range((att.resume or 0) + 1, att.until + 1):
        if att.abort_at == step:
            log.append(StepAborted(step=step, phase="train", error_type="RuntimeError", error="x"))
        loss = 0.123 if att.loss_bump == step else None
        ev = step_event(step, salt=att.salt, loss=loss)
        log.append(ev)
        totals[0], totals[1], totals[2] = step, totals[1] + 8, totals[2] + ev.valid_tokens
        if att.save_every and step % att.save_every == 0:
            log.append(
                CheckpointSaved(
                    step=step,
                    path=f"checkpoints/step_{step}",
                    total_steps=totals[0],
                    consumed_samples=totals[1],
                    total_valid_tokens=totals[2],
                )
            )
    if att.stop:
        log.append(RunStopped(reason=att.stop, last_step=att.until))


def totals_at(step: int) -> list[int]:
    """[steps, samples, tokens] after ``step`` steps of `step_event`."""
    return [step, 8 * step, sum(100 + s for s in range(1, step + 1))]


def write_run(run_dir: Path, attempts: list[Attempt], *, fsync: bool = False) -> Path:
    """Write each attempt through its own writer, as separate launches would."""
    for att in attempts:
        with open_log(run_dir, fsync=fsync) as log:
            run_attempt(log, att, totals_at(att.resume or 0))
    return run_dir / "events.jsonl"


def write_checkpoint(run_dir: Path, step: int) -> Path:
    """``RUN_DIR/checkpoints/step_<step>`` as far as `verify` reads it: a training_info.json
    holding the save state the run's log replays to at that step."""
    import json

    from sft_runtime.states import replay

    folder = run_dir / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    info = {"step": step, "save_state": replay(run_dir, until_step=step).to_dict()}
    (folder / "training_info.json").write_text(json.dumps(info))
    return folder

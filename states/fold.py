"""The fold: every event the controller records is built here, and the ones that move the
save state are folded here, each builder next to its handler.

A handler is ``(state, payload data) -> state``; `apply`, `replay` and the controller's
machine all fold through `HANDLERS`, so the rules of the save state (a step follows the last
one; a checkpoint agrees with the fold) are written once. Builders take plain facts, so
nothing here needs ray or torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sft_runtime.events.errors import LineageError
from sft_runtime.events.lineage import LogLike, records_in_effect, records_in_time
from sft_runtime.events.schemas import (
    CheckpointSaved,
    LoadersReady,
    Record,
    RunStarted,
    RunStopped,
    StepAborted,
    StepCommitted,
    ValidationCompleted,
)
from sft_runtime.states.save_state import SFTV2SaveState


# -- run_started -------------------------------------------------------------------------
def run_started_event(
    state: SFTV2SaveState,
    *,
    max_steps: int,
    logical_world_size: int,
    node_ids: Sequence[str],
    host: str,
    pid: int,
    config_digest: str | None = None,
    config_changes: dict[str, list[Any]] | None = None,
    optimizer_restored: bool | None = None,
) -> RunStarted:
    """An attempt starts from ``state`` (the initial one, or a checkpoint's) with a config
    of digest ``config_digest``, changed since that checkpoint by ``config_changes``."""
    return RunStarted(
        placement_hash=state.placement_hash,
        resumed_from_step=state.total_steps or None,
        max_steps=max_steps,
        logical_world_size=logical_world_size,
        config_digest=config_digest,
        config_changes={} if config_changes is None else dict(config_changes),
        optimizer_restored=optimizer_restored,
        node_ids=list(node_ids),
        host=host,
        pid=pid,
    )


def run_started(state: SFTV2SaveState, data: dict[str, Any]) -> SFTV2SaveState:
    return SFTV2SaveState(
        state.total_steps, state.consumed_samples, state.total_valid_tokens, data["placement_hash"]
    )


# -- loaders_ready (moves nothing) -------------------------------------------------------
def loaders_ready_event(
    owner_ranks: Sequence[int], logical_world_size: int, *, restored: bool, seconds: float
) -> LoadersReady:
    return LoadersReady(
        owner_ranks=list(owner_ranks),
        logical_world_size=logical_world_size,
        restored=restored,
        seconds=seconds,
    )


# -- step_committed ----------------------------------------------------------------------
def step_committed_event(
    step: int,
    metrics: Mapping[str, Any],
    *,
    timings: Mapping[str, float],
    sample_digests: Sequence[str],
    trace_id: str | None,
    span_id: str | None,
) -> StepCommitted:
    """Step ``step`` counts: its counters, loss, timings and per-rank sample digests."""
    return StepCommitted(
        step=step,
        source_samples=metrics["source_samples"],
        valid_tokens=metrics["valid_tokens"],
        physical_packs=metrics["physical_packs"],
        overlong_samples=metrics.get("overlong_samples", 0),
        skipped_samples=metrics.get("skipped_samples", 0),
        loss=metrics["loss"],
        grad_norm=metrics["grad_norm"],
        lr=metrics["lr"],
        timings=dict(timings),
        sample_digests=list(sample_digests),
        trace_id=trace_id,
        span_id=span_id,
    )


# -- step_committed: its handler -------------------------------------------------------
def next_counters(counters: tuple[int, int, int], data: dict[str, Any]) -> tuple[int, int, int]:
    """(steps, samples, tokens) after one ``step_committed``: the step-order rule lives here
    alone (a step follows the last one, nothing is skipped or repeated)."""
    steps, samples, tokens = counters
    step = data["step"]
    if step != steps + 1:
        raise ValueError(f"step {step} cannot follow total_steps {steps}")
    return step, samples + data["source_samples"], tokens + data["valid_tokens"]


def step_committed(state: SFTV2SaveState, data: dict[str, Any]) -> SFTV2SaveState:
    counters = (state.total_steps, state.consumed_samples, state.total_valid_tokens)
    return SFTV2SaveState(*next_counters(counters, data), state.placement_hash)


# -- step_aborted and run_stopped (move nothing) -----------------------------------------
def step_aborted_event(
    step: int,
    phase: str,
    error: BaseException,
    *,
    trace_id: str | None = None,
    span_id: str | None = None,
) -> StepAborted:
    return StepAborted(
        step=step,
        phase=phase,
        error_type=type(error).__name__,
        error=str(error)[:2000],
        trace_id=trace_id,
        span_id=span_id,
    )


def run_stopped_event(reason: str, last_step: int, error: str | None = None) -> RunStopped:
    return RunStopped(reason=reason, last_step=last_step, error=error)


# -- validation_completed (moves nothing: the weights it measured are a step's) -----------
def validation_completed_event(
    step: int,
    metrics: Mapping[str, Any],
    *,
    sample_digest: str,
    trace_id: str | None,
    span_id: str | None,
) -> ValidationCompleted:
    return ValidationCompleted(
        step=step,
        loss=metrics["val_loss"],
        tokens=metrics["val_tokens"],
        samples=metrics["val_samples"],
        sample_digest=sample_digest,
        seconds=metrics["val_time"],
        trace_id=trace_id,
        span_id=span_id,
    )


# -- checkpoint_saved --------------------------------------------------------------------
def checkpoint_saved_event(
    state: SFTV2SaveState, path: Path, metric: float | None, seconds: float
) -> CheckpointSaved:
    """A checkpoint of ``state`` is complete at ``path``."""
    return CheckpointSaved(
        step=state.total_steps,
        path=str(path),
        total_steps=state.total_steps,
        consumed_samples=state.consumed_samples,
        total_valid_tokens=state.total_valid_tokens,
        metric=metric,
        seconds=seconds,
    )


def checkpoint_saved(state: SFTV2SaveState, data: dict[str, Any]) -> SFTV2SaveState:
    saved = (data["total_steps"], data["consumed_samples"], data["total_valid_tokens"])
    folded = (state.total_steps, state.consumed_samples, state.total_valid_tokens)
    if saved != folded:
        raise ValueError(
            f"checkpoint of step {data['step']} records (steps, samples, tokens) = {saved} "
            f"but the log folds to {folded}"
        )
    return state


# -- the fold ----------------------------------------------------------------------------
HANDLERS: dict[str, Callable[[SFTV2SaveState, dict[str, Any]], SFTV2SaveState]] = {
    "run_started": run_started,
    "step_committed": step_committed,
    "checkpoint_saved": checkpoint_saved,
}


def apply(state: SFTV2SaveState, record: Record) -> SFTV2SaveState:
    """Fold one record into the save state; types that do not move it leave it as is."""
    handler = HANDLERS.get(record.type)
    return state if handler is None else handler(state, record.data)


def replay(log: LogLike, until_step: int | None = None) -> SFTV2SaveState:
    """The save state after the records in effect, stopping after step ``until_step``.

    The same fold as `apply` over `records_in_effect` (a property test holds them equal).
    The whole log folds in one pass (`_fold_rewinding`); a stop at a step, or a log whose
    rolled-back checkpoint disagrees with the fold, takes the records in effect instead.
    Raises `events.LineageError` (naming the line) when a record cannot be folded.
    """
    if until_step is None:
        state = _fold_rewinding(log)
        if state is not None:
            return state
    return _fold_in_effect(log, until_step)


def _fold_rewinding(log: LogLike) -> SFTV2SaveState | None:
    """Fold every record in time order; a resume from step K rewinds to checkpoint K.

    At the end the live lineage is exactly the records in effect, so the counters agree
    with `_fold_in_effect` without the pass that finds the rolled-back steps first.
    ``step_committed`` (nearly every line) keeps the counters as plain integers; the step
    order it relies on is checked by `records_in_time`. Returns None when a checkpoint
    disagrees with the fold: whether that is an error depends on whether the checkpoint
    was rolled back, which only the records in effect can tell.
    """
    steps = samples = tokens = 0
    placement = ""
    saved = {0: (0, 0, 0)}  # step -> counters of the latest checkpoint of that step
    for rec in records_in_time(log):
        data = rec.data
        type_ = rec.type
        if type_ == "step_committed":
            steps, samples, tokens = (
                data["step"],
                samples + data["source_samples"],
                tokens + data["valid_tokens"],
            )
        elif type_ == "run_started":
            steps, samples, tokens = saved[data.get("resumed_from_step") or 0]
            placement = run_started(
                SFTV2SaveState(steps, samples, tokens, placement), data
            ).placement_hash
        elif type_ == "checkpoint_saved":
            try:  # the handler's own rule: a checkpoint agrees with the fold
                checkpoint_saved(SFTV2SaveState(steps, samples, tokens, placement), data)
            except ValueError:
                return None
            saved[steps] = (steps, samples, tokens)
    return SFTV2SaveState(steps, samples, tokens, placement)


def _fold_in_effect(log: LogLike, until_step: int | None) -> SFTV2SaveState:
    """`apply` over `records_in_effect`, with ``step_committed`` kept as plain integers
    (`next_counters`, the handler's own rule) instead of a save state per line."""
    placement = ""
    counters = (0, 0, 0)
    stop = math.inf if until_step is None else until_step
    rec = None
    try:
        for rec in records_in_effect(log):
            if rec.type == "step_committed":
                if rec.data["step"] > stop:
                    break
                counters = next_counters(counters, rec.data)
            elif rec.type in HANDLERS:
                state = HANDLERS[rec.type](SFTV2SaveState(*counters, placement), rec.data)
                placement = state.placement_hash
    except ValueError as exc:
        if rec is None:
            raise
        raise LineageError(getattr(log, "path", str(log)), rec.line, str(exc)) from None
    if until_step is not None and counters[0] < until_step:
        raise ValueError(f"the log ends at step {counters[0]}, before step {until_step}")
    return SFTV2SaveState(*counters, placement)

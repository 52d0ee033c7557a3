"""How a controller opens an attempt, undoes a failed step and ends the attempt.

An attempt opens (`open_attempt`) by taking the run's log (fenced against another writer),
building the machine on the save state replay gave, and recording ``run_started``.

A failed step (`undo_step`) is undone in the workers (a step sent ahead is waited for and
whatever of it is open aborted) and recorded as ``step_aborted``; the attempt ends, and a
resume goes on from the last checkpoint as if the step never began.

An attempt ends (`end_attempt`) in order: the loaders closed after their last commit, the
workers' spans flushed within the shutdown bound (this process and the driver spend what
they left of it), the machine closed and ``run_stopped`` recorded. Every cleanup step only
warns when it fails (`quietly`), so the error that ended the run is the one reported. Each
takes what it acts on as arguments: the controller's loop owns the state, these own the
order.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry import trace

from sft_runtime.events import PlacementChanged, open_log
from sft_runtime.runtime.config import MasterConfig, step_rules
from sft_runtime.runtime.errors import quietly
from sft_runtime.runtime.metrics.metrics_log import MetricsLogger
from sft_runtime.runtime.process.faults import fault_point
from sft_runtime.runtime.resume.config_change import config_record
from sft_runtime.runtime.resume.placement_change import workers_change
from sft_runtime.states import ControllerModel, ControllerState, StepInFlight, fold
from sft_runtime.traces.context import inject_carrier, span_ids


def open_attempt(
    config: MasterConfig,
    args: Any,
    run_dir: Path,
    *,
    max_steps: int,
    step_ahead: Callable[[], bool],
    killed_at_end: bool = False,
) -> tuple[Any, ControllerModel, MetricsLogger]:
    """(the log, the machine in ``setup`` after ``run_started``, the metrics logger) of a new
    attempt; ``args`` are the actor's (`SFTV2ActorArgs`: the driver, save state, plan);
    ``step_ahead`` tells the machine whether the workers were sent the next step already;
    ``killed_at_end``: the process is killed after the attempt (`MetricsLogger.for_run`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = args.train_cluster
    owner = {k: cluster[k] for k in ("driver_pid", "driver_host") if k in cluster}
    log = open_log(run_dir, owner=owner)
    state = args.save_state
    rules = step_rules(config, now=time.time())
    model = ControllerModel(rules, log=log, save_state=state, step_ahead=step_ahead)
    try:
        metrics = MetricsLogger.for_run(
            config.logger,
            run_dir,
            first_step=state.total_steps + 1,
            run_config=config.model_dump(mode="json"),
            killed_at_end=killed_at_end,
        )
    except BaseException:
        quietly("close the log", log.close)  # nothing recorded yet: the attempt never began
        raise
    # the driver compared the config with the checkpoint's (`setup_sft_v2`); args made by
    # hand carry no record, and the attempt records its config's digest alone
    record = cluster.get("config_record") or config_record(config)
    event = fold.run_started_event(
        state,
        max_steps=max_steps,
        logical_world_size=args.placement_plan.logical_world_size,
        node_ids=cluster.get("node_ids", []),
        host=socket.gethostname(),
        pid=os.getpid(),
        config_digest=record.digest,
        config_changes=record.changes,
        optimizer_restored=record.optimizer_restored,
    )
    plan = args.placement_plan
    change = workers_change(config, record.changes or {}) if state.total_steps else None
    try:
        model.start(event=event)
        if change is not None:
            model.placement_changed(
                event=PlacementChanged(
                    resumed_from_step=state.total_steps,
                    old_world_size=change.old_world_size,
                    new_world_size=change.new_world_size,
                    shards=plan.logical_world_size,
                    shard_map=plan.shard_map,
                )
            )
    except BaseException:  # the backends' runs end here, not at the process's exit
        quietly("close the metrics logger", lambda: metrics.close("failed"))
        raise
    return log, model, metrics


def undo_step(
    exc: BaseException,
    in_flight: StepInFlight,
    *,
    pipeline: Any,
    group: Any,
    model: ControllerModel,
) -> None:
    """Undo what the step opened (`Pipeline` ``pipeline``, on the worker ``group``), then record
    ``step_aborted`` through ``model``; cleanup failures only warn."""
    phase = in_flight.failed_phase(exc)
    quietly("wait for the step's calls", pipeline.settle)
    policy_open, batch_active = in_flight.policy_open, in_flight.batch_active
    if pipeline.has_ahead:  # a step sent ahead is given up with this one
        policy_open = batch_active = True
        quietly("give up the step sent ahead", pipeline.drop_ahead)
    if policy_open:
        quietly("abort the policy step", lambda: group.abort_train_step(carrier=inject_carrier()))
    if batch_active:
        quietly("abort the loader batches", lambda: group.abort_batches(carrier=inject_carrier()))
    span = span_ids(trace.get_current_span())
    quietly(
        "record step_aborted",
        lambda: model.fail(error=exc, phase=phase.value, trace_id=span[0], span_id=span[1]),
    )


def end_attempt(
    reason: str,
    error: BaseException | None,
    *,
    close_loaders: Callable[[], None],
    group: Any,
    flush_bound_s: float,
    metrics: Any,
    model: ControllerModel | None,
    log: Any,
    attempt: int | None,
) -> float:
    """Teardown in order: loaders, the workers' spans, logger, machine; then run_stopped.

    Returns the seconds of ``flush_bound_s`` the workers' flush left, which this process and
    then the driver spend on their own flushes: a dead collector costs the run the bound
    once, while the rest of the close (slow on a busy machine) spends none of it, so no
    process loses its spans to a close that outlasted the bound."""
    quietly("close the loaders", close_loaders)
    flush_by = time.time() + flush_bound_s
    quietly(
        "export the workers' spans",
        lambda: group.flush_telemetry(deadline=flush_by, carrier=inject_carrier()),
    )
    flush_left_s = max(0.0, flush_by - time.time())
    if metrics is not None:
        quietly("close the metrics logger", lambda: metrics.close(reason))
    if model is not None and log is not None:
        if model.state in (ControllerState.setup, ControllerState.ready):
            quietly("close the machine", model.close)
        elif model.state is ControllerState.saving:  # only an error ends an attempt here
            failed = error if error is not None else RuntimeError(f"ended while saving: {reason}")
            quietly("close the machine", lambda: model.fail(error=failed))
        if model.state is ControllerState.closing:
            step = model.save_state.total_steps
            fault_point("closing:before_stop", step=step, attempt=attempt)
            msg = None if error is None else f"{type(error).__name__}: {error}"[:2000]
            quietly("record run_stopped", lambda: model.finish(reason=reason, error=msg))
    if log is not None:
        log.close()
    return flush_left_s


def end_reason(model: ControllerModel, *, stopping: bool) -> str:
    """Why an attempt that raised nothing ended: interrupted, completed or timeout."""
    if stopping:
        return "interrupted"
    if model.rules.budget_reached(model.save_state):
        return "completed"
    return "timeout" if model.save_by_timeout() else "completed"

"""`SFTController`: the single controller's run loop, a short sequence of trigger calls.

The loop reads like the recipe: set up the loaders, then while ``ready`` halt or run one
step (``training`` from its send to its commit), and save when the machine went to
``saving``. The table in `states.machine` says
which moves exist; this module does each phase's work and fires the trigger that records
it. `controller.actor.SFTSingleControllerActor` is this class made remote.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from sft_runtime.events.log import EventLog, next_attempt
from sft_runtime.runtime.checkpoint.save import Checkpointer
from sft_runtime.runtime.config import (
    MasterConfig,
    _max_train_steps,
    loader_spec,
    run_checkpoints,
)
from sft_runtime.runtime.controller.attempt import (
    end_attempt,
    end_reason,
    open_attempt,
    undo_step,
)
from sft_runtime.runtime.controller.pipeline import Pipeline
from sft_runtime.runtime.controller.validation import Validator
from sft_runtime.runtime.data.factory import loader_factory, owned_states
from sft_runtime.runtime.errors import DiskFullError, DivergedError, quietly
from sft_runtime.runtime.metrics.metrics_log import MetricsLogger
from sft_runtime.runtime.metrics.step_metrics import (
    SFT_V2_TEED_METRICS,
    RunSummary,
    RunTally,
    StepMetrics,
    check_envelopes,
    run_summary,
    sample_digest,
    step_attributes,
    step_metrics,
    step_timings,
)
from sft_runtime.runtime.policy.step_outcome import StepFinished
from sft_runtime.runtime.process.disk_full import disk_full_error
from sft_runtime.runtime.process.faults import fault_point
from sft_runtime.runtime.process.liveness import check_driver
from sft_runtime.runtime.process.niceness import controller_niceness, set_niceness
from sft_runtime.runtime.process.step_census import step_census
from sft_runtime.runtime.resume.input_identity import config_identities
from sft_runtime.runtime.workers.calls import Pending
from sft_runtime.runtime.workers.results import StepStarted, StepTrained
from sft_runtime.states import ControllerModel, ControllerState, StepInFlight, StepPhase, fold
from sft_runtime.traces.config import SHUTDOWN_TIMEOUT_S
from sft_runtime.traces.context import attached, inject_carrier
from sft_runtime.traces.setup import setup_telemetry
from sft_runtime.traces.spans import (
    EVENT_APPEND_SPAN,
    JOB_SPAN,
    PHASE_ATTR,
    SAVE_SPAN,
    SETUP_SPANS,
    record_error,
    traced,
)
from sft_runtime.traces.step_trace import StepInstruments, StepTrace, TraceOrigin

SEED_STEPS = (
    "_setup_loaders",
    "_load_envelopes",
    "_run_train_step",
    "_policy_metrics",
    "_owner_call",
    "_loader_state_dicts",
    "_should_save",
    "_checkpoint_metric",
    "_save_checkpoint",
    "_close_loaders",
)
"""The private steps the seed API names (DESIGN.md): the methods `run` really calls, so an
embedding user who reads or overrides one changes the path that runs."""


class SFTController:
    """Drives the policy workers through the machine's states for one attempt of a run."""

    def __init__(self, master_config: MasterConfig, actor_args: Any) -> None:
        self.config = master_config
        self.args = actor_args
        self.group = actor_args.trainer
        self.plan = actor_args.placement_plan
        self._world = self.plan.logical_world_size  # the loaders' ranks, read every step
        self.run_dir = Path(master_config.logger.log_dir or ".")  # as the driver reads it
        self.checkpointer = Checkpointer(
            master_config.checkpointing,
            self.group,
            run_checkpoints(master_config),
            run_config=master_config.model_dump(mode="json"),
            num_threads=master_config.cluster.num_threads_per_worker,
            identities=config_identities(master_config),
        )
        self.ckpt = self.checkpointer.store
        self.max_steps = _max_train_steps(master_config)
        self._stop = threading.Event()
        self.tally = RunTally()  # this attempt's committed steps
        self.log: EventLog | None = None
        self.pipeline = Pipeline(self.group, actor_args.loss_fn, self.checkpointer)
        self.validator = Validator(master_config, self.group)
        self._origin = TraceOrigin()  # what every step trace of the attempt shares
        self._trace: StepTrace | None = None  # the trace of the step in flight
        self._flush_left_s: float | None = None  # the shutdown bound the workers' flush left
        self._killed_at_end = False  # the process ends by `ray.kill`: no exit hook runs
        self._step_attributes: dict[str, Any] | None = None
        self.model: ControllerModel | None = None
        self.metrics: MetricsLogger | None = None
        self.instruments = StepInstruments(SFT_V2_TEED_METRICS)

    # -- entry points --------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the loop to stop at the next step boundary (after a final checkpoint); a step
        already sent ahead to the workers is recorded first."""
        self._stop.set()

    def run_with_trace_context(self, _otel_carrier: dict | None = None) -> RunSummary:
        """`run` in the controller actor: a little nicer than the workers (see
        process/niceness.py), as a child of the driver's span; exports this process's spans at
        the end. The driver kills the actor once it has the summary (`kill_and_wait`)."""
        self._killed_at_end = True
        set_niceness(controller_niceness(self.config.cluster.worker_niceness))
        telemetry = setup_telemetry(
            self.config.telemetry,
            role="controller",
            run_dir=self.run_dir,
            attempt=next_attempt(self.run_dir),  # as the log will number it when opened
        )
        try:
            with attached(_otel_carrier):
                summary = self.run()
        except Exception as exc:
            full = self._as_disk_full(exc)
            if full is None:
                raise
            raise full from exc
        finally:
            flush_left_s = telemetry.flush_within(self._flush_left_s)
        summary["telemetry_flush_s"] = flush_left_s  # the driver's share of the bound
        return summary

    def _as_disk_full(self, exc: Exception) -> DiskFullError | None:
        """``exc`` as a `DiskFullError` (one line; the step a resume starts from) when a
        write in its chain was refused for space, else None: told here, where the chain is
        whole (Ray drops ``__cause__`` on the way to the driver)."""
        full = disk_full_error(exc, where=self.run_dir)
        if full is None:
            return None
        saved = self.ckpt.steps()
        return DiskFullError(full.errno, full.what, saved[-1] if saved else 0)

    def run(self) -> RunSummary:
        with traced(JOB_SPAN) as job:
            with traced(SETUP_SPANS["open_log"]):
                self._open()
            self._origin = TraceOrigin.of_job(self._attempt, job)
            start_step = self._machine.save_state.total_steps
            reason, error = "completed", None
            try:
                with traced(SETUP_SPANS["loaders"]):
                    self._setup_loaders()
                self._validate_if_due()  # before the first step (sft.val_at_start)
                while self._machine.state is ControllerState.ready:
                    self._check_driver()
                    self._machine.stop_requested = self._stop.is_set()
                    # a step sent ahead runs first (Pipeline); then saving, when unsaved
                    if not self.pipeline.has_ahead and self._machine.halt():
                        if self._should_save(save_by_timeout=self._machine.save_by_timeout()):
                            self._save_checkpoint()
                        break
                    self._run_one_step()
                    self._validate_if_due()
                    if self._should_save(save_by_timeout=self._machine.deadline_verdict()):
                        self._save_checkpoint()
                reason = end_reason(self._machine, stopping=self._stop.is_set())
            except BaseException as exc:
                reason, error = _failure_reason(exc), exc
                record_error(job, exc)
                raise
            finally:
                self._close(reason, error)
            return self._summary(start_step, reason)

    # -- phases --------------------------------------------------------------------------
    def _open(self) -> None:
        self.log, self.model, self.metrics = open_attempt(
            self.config,
            self.args,
            self.run_dir,
            max_steps=self.max_steps,
            step_ahead=lambda: self.pipeline.has_ahead,
            killed_at_end=self._killed_at_end,
        )
        self.validator.read_log(self.log)  # after run_started: what this resume rolled back

    def _setup_loaders(self) -> None:
        cfg, plan = self.config, self.plan
        spec = loader_spec(cfg, plan.logical_world_size)
        owners = plan.owner_ranks
        if owners != self.group.owner_ranks:
            raise RuntimeError(
                f"placement plan owners {owners} != workers {self.group.owner_ranks}"
            )
        factories = [loader_factory(spec, plan, owner) for owner in owners]
        t0 = time.perf_counter()
        self.group.setup_telemetry(
            cfg.telemetry, str(self.run_dir), self._attempt, carrier=inject_carrier()
        )
        restored = owned_states(plan, self.args.loader_states)
        depth = cfg.data_plane.max_partitions  # batches an owner may hold: >= 2 prefetches
        self.group.setup_loaders(
            factories,
            restored,
            **({"prefetch_depth": depth} if depth > 1 else {}),
            load_during_allreduce=cfg.data_plane.load_during_allreduce,
        )
        fault_point(
            "setup:after_loaders", step=self._machine.save_state.total_steps, attempt=self._attempt
        )
        self.group.prepare_for_training(carrier=inject_carrier())
        self._machine.loaders_ready(
            event=fold.loaders_ready_event(
                owners,
                plan.logical_world_size,
                restored=restored is not None,
                seconds=time.perf_counter() - t0,
            )
        )

    def _run_one_step(self) -> None:
        step = self._machine.save_state.total_steps + 1
        # its start was sent with the last step, or it starts now
        trace = self.pipeline.ahead_trace(step)
        if trace is None:
            trace = StepTrace(step, self._origin)
        self._trace = trace
        in_flight = StepInFlight()  # how far the step got, what an abort must undo
        try:
            with trace.current(), step_census("controller", step):
                self._step_in(trace, step, in_flight)
        except BaseException as exc:
            trace.error = exc
            raise
        finally:
            trace.end(attributes=self._step_attributes)
            self._trace = None

    def _step_in(self, trace: StepTrace, step: int, in_flight: StepInFlight) -> None:
        """The step's work under its trace: train, metrics, commit, record (or abort)."""
        self._step_attributes = None
        try:
            trace.began()  # a step sent ahead may have begun earlier, in the workers
            with trace.training():
                envelopes, results = self._run_train_step(step)
            t_done = trace.seconds_since_start()
            in_flight.trained()
            self._fault_after(StepPhase.train, step)
            metrics = step_metrics(
                envelopes, results, trained_s=t_done, total_time=trace.seconds_since_start()
            )
            in_flight.enter(StepPhase.metrics)  # the config checked the checkpoint metric
            self._check_finite(step, metrics)
            in_flight.enter(StepPhase.commit)
            self._check_driver()  # a killed run commits no step after its driver died
            self.pipeline.recorded()  # the loader commit goes with the next start
            in_flight.committed()
            self._fault_after(StepPhase.commit, step)
            in_flight.enter(StepPhase.record)
            trace_id, span_id = trace.ids
            payload = fold.step_committed_event(
                step,
                metrics,
                timings=step_timings(metrics),
                sample_digests=[sample_digest(e.source_ids) for e in envelopes],
                trace_id=trace_id,
                span_id=span_id,
            )
            with traced(EVENT_APPEND_SPAN, attributes={PHASE_ATTR: StepPhase.record.value}):
                self._machine.commit(event=payload)
            self._fault_after(StepPhase.record, step)
        except BaseException as exc:
            self._abort_step(exc, in_flight)
            raise
        self.tally.add(metrics)
        self._metrics_log.log(step, metrics)
        self.instruments.record(metrics, {"attempt": self._attempt})
        if trace.recording:
            consumed = self._machine.save_state.consumed_samples
            self._step_attributes = step_attributes(metrics, consumed)

    def _check_finite(self, step: int, metrics: StepMetrics) -> None:
        """A non-finite loss or norm: the workers did not apply the update (`Replica.finish`).
        The step is then aborted and the run stops, or, with ``sft.skip_nonfinite_steps``, it
        is committed as it was and counted."""
        loss, norm = metrics["loss"], metrics["grad_norm"]
        if math.isfinite(loss) and math.isfinite(norm):
            return
        if not self.config.sft.skip_nonfinite_steps:
            saved = self.ckpt.steps()
            raise DivergedError(step, loss, norm, saved[-1] if saved else None)
        metrics["nonfinite_skipped"] = 1

    def _run_train_step(self, step: int) -> tuple[list, list[StepFinished]]:
        """Send the step (unless sent ahead), and the next step when it is certain to follow
        (`Pipeline`); then wait: envelopes and finish metrics."""
        if self._trace is None:
            raise RuntimeError("_run_train_step runs inside its step's trace (_run_one_step)")
        sent = self.pipeline.send(step, self._trace)
        self._machine.step_sent()
        state = replace(self._machine.save_state, total_steps=step)
        # the next step, sent now, ends about two mean steps from now: is the deadline closer?
        soon = self._machine.deadline_within(2)
        after = self._machine.rules.after(
            state,
            stopping=self._stop.is_set(),
            timed_out=soon,
            validated=step in self.validator.done,
        )
        if after.straight_on:
            self.pipeline.send_ahead(step + 1, commit=True, origin=self._origin)
        elif after.saves and not (after.validate or after.stop):
            # a save is due, and the run goes on after it
            self.pipeline.send_save_ahead(state, origin=self._origin)
        trained: list[StepTrained] = self.group.wait(sent)
        envelopes = self._load_envelopes([t.started for t in trained], step)
        return envelopes, [t.finished for t in trained]

    def _load_envelopes(self, outs: list[StepStarted], step: int) -> list:
        """The owners' envelopes from the step's starts: the batch was loaded (it stays in
        the workers)."""
        if outs and self._trace is not None:  # a step sent ahead began when a worker took it
            self._trace.began(min(o.started_ns for o in outs))
        envelopes = [s for rank in self.group.owner_ranks for s in outs[rank].envelope.per_shard()]
        check_envelopes(envelopes, self._world)
        self._fault_after(StepPhase.loading, step)
        return envelopes

    def _policy_metrics(self) -> dict[str, Any]:
        """The last committed step's metrics (what a checkpoint is ranked by)."""
        return dict(self.tally.last)

    def _owner_call(self, call: Any) -> Any:
        """One of the group's loader-owner calls (``self.group.close_loaders``, ...), joined to
        this span's trace."""
        return call(carrier=inject_carrier())

    def _validate_if_due(self) -> None:
        """A validation pass on the weights of the last committed step, when one is due
        there (``sft.val_period``, ``val_at_start``, ``val_at_end``) and the log holds none."""
        state = self._machine.save_state
        step = state.total_steps
        if not self._machine.rules.after(state, validated=step in self.validator.done).validate:
            return
        metrics = self.validator.run(step, self._machine, self._attempt)
        self._metrics_log.log(step, metrics, prefix="val")

    def _close_loaders(self) -> None:
        """The last step's batch committed (a step sent ahead given up), then the loaders closed."""
        try:
            self.pipeline.drop_ahead()
            self.pipeline.flush_commit()
        finally:
            self._owner_call(self.group.close_loaders)

    # -- saving --------------------------------------------------------------------------
    def _should_save(self, *, save_by_timeout: bool) -> bool:
        """Whether a checkpoint is written now: the machine's save rules moved it to
        ``saving`` (a save period, the end of the budget, a stop request, or the deadline,
        whose verdict ``save_by_timeout`` is: the guards read the same latched one)."""
        model = self._machine
        saving = model.state is ControllerState.saving
        if save_by_timeout and model.rules.checkpointing and not saving:
            if model.save_state.total_steps > model.last_saved_step:
                raise RuntimeError(
                    "the deadline passed with unsaved steps but the machine is not saving"
                )
        return saving

    def _checkpoint_metric(self, metrics: dict[str, Any]) -> dict[str, float]:
        """``{"train:<name>": value}`` for ``checkpointing.metric_name`` (``{}`` without
        one; ``val:<name>`` from the latest validation); the config refuses an unknown name
        before Ray starts."""
        return self.checkpointer.metric(metrics, self.validator.latest)

    def _loader_state_dicts(self, sent: Pending | None = None) -> list[bytes]:
        """Each owner's loader state at the last committed step, pickled in the worker (see
        `dump_loader_state`): the calls a save `sent` ahead of its writes, or sent now."""
        if sent is None:
            sent = self._owner_call(self.pipeline.send_loader_states)
        return [blob for owner in self.group.wait(sent) for blob in owner]  # one per shard

    def _save_checkpoint(self) -> None:
        """Write the checkpoint of the save state; the workers go on to the next step (sent
        behind their files) while the controller completes the directory. The loader states
        come first, then the writes, then the next step, all sent before anything is waited
        for: with the step before the save (`Pipeline.send_save_ahead`) or now."""
        model, attempt = self._machine, self._attempt
        state, rules = model.save_state, model.rules
        stopping, timed_out = model.stop_verdicts()
        kinds = rules.after(state, stopping=stopping, timed_out=timed_out).save_kinds
        metrics = self._policy_metrics()
        metric = self._checkpoint_metric(metrics) if metrics else {}
        ahead = self.pipeline.take_save_ahead(state.total_steps, final="final" in kinds)
        if ahead is not None:
            with ahead.current():
                ahead.write.describe(state, kinds=kinds, metric=metric)
                self._complete_save(ahead.states, ahead.write)
        else:
            with traced(SAVE_SPAN, attributes={"step": state.total_steps, "attempt": attempt}):
                states = self._owner_call(self.pipeline.send_loader_states)  # before the writes
                write = self.checkpointer.begin(
                    state,
                    kinds=kinds,
                    metric=metric,
                    attempt=attempt,
                    final=rules.budget_reached(state),
                    carrier=inject_carrier(),
                )
                self._complete_save(states, write, past=state)
        fault_point("saving:after_record", step=state.total_steps, attempt=attempt)
        quietly("prune old checkpoints", self.checkpointer.prune)

    def _complete_save(self, states: Pending, write: Any, *, past: Any = None) -> None:
        """Wait for the loader states (first sending the next step's start behind the writes,
        for a save sent now, when the run goes on after it: ``past`` is its state), complete
        the directory, record it; the writes are discarded if anything before the completion
        fails."""
        model = self._machine
        try:
            if past is not None and self._goes_on_after(past):
                step = past.total_steps + 1  # the save committed its batch
                self.pipeline.send_ahead(step, commit=False, origin=self._origin)
            loader_states = self._loader_state_dicts(states)
        except BaseException:
            quietly("discard the checkpoint", write.discard)
            raise
        model.saved(event=write.complete(loader_states))

    def _goes_on_after(self, state: Any) -> bool:
        """The run continues after ``state``'s checkpoint: no stop request, no budget end,
        no deadline forecast within two steps."""
        soon = self._machine.deadline_within(2)
        return not self._machine.rules.after(
            state, stopping=self._stop.is_set(), timed_out=soon
        ).stop

    def _abort_step(self, exc: BaseException, in_flight: StepInFlight) -> None:
        self.pipeline.discard_save_ahead()
        undo_step(exc, in_flight, pipeline=self.pipeline, group=self.group, model=self._machine)

    def _close(self, reason: str, error: BaseException | None) -> None:
        self.pipeline.discard_save_ahead()  # a step recorded, then the run failed before its save
        telemetry = self.config.telemetry
        bound_s = telemetry.shutdown_timeout_s if telemetry is not None else SHUTDOWN_TIMEOUT_S
        self._flush_left_s = end_attempt(
            reason,
            error,
            close_loaders=self._close_loaders,
            group=self.group,
            flush_bound_s=bound_s,
            metrics=self.metrics,
            model=self.model,
            log=self.log,
            attempt=self._attempt,
        )

    def _summary(self, start_step: int, reason: str) -> RunSummary:
        summary = run_summary(
            self._machine.save_state,
            reason=reason,
            attempt=_opened(self.log).attempt,
            start_step=start_step,
            max_steps=self.max_steps,
            losses=self.tally.losses,
            checkpoints=self.ckpt.steps(),
            run_dir=self.run_dir,
            sample_counts=self.tally.sample_counts,
            nonfinite_skipped=self.tally.nonfinite_skipped,
        )
        return summary

    def _fault_after(self, phase: StepPhase, step: int) -> None:
        fault_point(phase.fault_point, step=step, attempt=self._attempt)

    def _check_driver(self) -> None:
        check_driver(self.args.train_cluster)

    @property
    def _attempt(self) -> int | None:
        return None if self.log is None else self.log.attempt

    @property
    def _machine(self) -> ControllerModel:
        """`model`, the attempt's machine."""
        return _opened(self.model)

    @property
    def _metrics_log(self) -> MetricsLogger:
        """`metrics`, the attempt's metrics logger."""
        return _opened(self.metrics)


_Part = TypeVar("_Part")


def _opened(part: _Part | None) -> _Part:
    """One of the attempt's objects (the log, the machine, the metrics logger), which
    `_open` makes first thing in `run`."""
    if part is None:
        raise RuntimeError("the controller's attempt is not open yet (run() opens it)")
    return part


def _failure_reason(exc: BaseException) -> str:
    """The ``run_stopped`` reason of an attempt that raised ``exc``."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return "diverged" if isinstance(exc, DivergedError) else "failed"

"""The driver: set up, start the controller actor, follow its progress, stop it cleanly.

Ctrl-C or SIGTERM (what a scheduler sends before preemption) asks the controller to stop
at the next step boundary, where it saves a checkpoint and records ``run_stopped``
(``interrupted``); a second signal stops at once. Either way the workers and the placement
group are removed before the driver returns.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import ray

from sft_runtime.events.log import next_attempt
from sft_runtime.runtime.config import MasterConfig
from sft_runtime.runtime.controller.actor import SFTSingleControllerActor
from sft_runtime.runtime.errors import RunFailure, UserInputError, quietly
from sft_runtime.runtime.launch.run_lock import holding_run
from sft_runtime.runtime.launch.setup import setup_sft_v2
from sft_runtime.runtime.metrics.step_metrics import RunSummary
from sft_runtime.runtime.process.faults import actor_fault_options, fault_point
from sft_runtime.runtime.resume.placement_change import with_shards
from sft_runtime.runtime.workers.actor_exit import kill_and_wait
from sft_runtime.traces.context import inject_carrier
from sft_runtime.traces.setup import setup_telemetry
from sft_runtime.traces.spans import DRIVER_SPAN, traced

STOP_ACK_TIMEOUT_S = 60.0


class RunInterrupted(Exception):
    """The run stopped because of a signal; the summary of what was saved is attached."""

    def __init__(self, summary: RunSummary | None) -> None:
        super().__init__("interrupted")
        self.summary = summary


class _Signals:
    """Counts SIGINT/SIGTERM while installed (only possible in the main thread)."""

    def __init__(self) -> None:
        self.count = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class MetricsTail:
    """Reads the lines the controller appends to metrics.jsonl, for progress display."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self._partial = b""

    def new_rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        data, rows = self._partial + data, []
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if line:
                rows.append(orjson.loads(line))
        return rows


def run_training(
    config: MasterConfig,
    *,
    tokenizer: Any = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_stop_request: Callable[[], None] | None = None,
) -> RunSummary:
    """Train until the budget, a deadline or a signal; returns the controller's summary.

    Raises `RunInterrupted` after a clean stop on a signal, and the original error when a
    step fails.
    """
    from sft_runtime.runtime.data.bring import bring_data
    from sft_runtime.runtime.launch.absolute_paths import with_absolute_paths

    config = bring_data(config)  # NeMo RL's data files, prepared before anything starts
    config = with_absolute_paths(config)  # Ray's processes do not stand where the user does
    run_dir = Path(config.logger.log_dir or ".")
    with holding_run(run_dir):  # before the resume point is read: a second launch is refused
        attempt = next_attempt(run_dir)  # the controller opens the log later; label it now
        telemetry = setup_telemetry(
            config.telemetry, role="driver", run_dir=run_dir, attempt=attempt
        )
        summary: RunSummary | None = None
        try:
            with traced(DRIVER_SPAN):
                summary = _drive(config, tokenizer, on_step, on_stop_request)
                return summary
        except RunInterrupted as exc:
            summary = exc.summary
            raise
        finally:
            if next_attempt(run_dir) == attempt:  # refused: the log never had this attempt
                quietly("discard the refused launch's traces", telemetry.discard_files)
            else:
                _export_traces(telemetry, config, run_dir, summary)


def _export_traces(telemetry: Any, config: MasterConfig, run_dir: Path, summary) -> None:
    """Flush this process's spans (within what the workers and the controller left of the
    shutdown bound, or the whole bound when no summary came back) and merge every process's
    into the run's Jaeger files."""
    telemetry.flush_within((summary or {}).get("telemetry_flush_s"))
    tel = config.telemetry
    if tel is not None and tel.enabled and "jaeger_file" in tel.exporters:
        from sft_runtime.traces.merge import merge_trace_files

        attempt = (summary or {}).get("attempt")
        quietly(
            "merge the trace files",
            lambda: merge_trace_files(
                run_dir, max_spans=tel.jaeger_file_max_spans, default_attempt=attempt
            ),
        )


def _ask_to_stop(controller: Any) -> None:
    """Wait for the controller to take the request before the user is told (the stop then
    lands at the end of the step in flight); a controller that is gone or stuck is left to
    the run's own result."""
    try:
        ray.get(controller.request_stop.remote(), timeout=STOP_ACK_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        print(f"warning: the controller did not take the stop request: {exc}", file=sys.stderr)


def _result(ref: Any) -> RunSummary:
    """The controller's summary. Bad input found while the run was under way (a sample the
    chat template refuses, a damaged shard) is raised as itself, not inside Ray's wrapper,
    whose text carries the controller's traceback: the user gets the one line it says."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, (UserInputError, RunFailure)):
            raise exc.cause from None
        raise


def _drive(config, tokenizer, on_step, on_stop_request) -> RunSummary:
    args = setup_sft_v2(config, tokenizer)
    # the data shards it resolved (fixed at the run's start) go into every checkpoint's config
    config = with_shards(config, args.placement_plan.logical_world_size)
    controller = None
    try:
        fault_point("driver:after_setup")
        controller = SFTSingleControllerActor.options(**actor_fault_options()).remote(config, args)
        ref = controller.run_with_trace_context.remote(_otel_carrier=inject_carrier())
        tail = MetricsTail(Path(config.logger.log_dir or ".") / "metrics.jsonl")
        asked = 0
        with _Signals() as signals:
            while True:
                done, _ = ray.wait([ref], timeout=0.1)
                if on_step is not None:
                    for row in tail.new_rows():
                        on_step(row)
                if done:
                    break
                if signals.count > asked:
                    asked = signals.count
                    if asked == 1:
                        _ask_to_stop(controller)
                        if on_stop_request is not None:
                            on_stop_request()
                    else:
                        raise KeyboardInterrupt("second signal: stopping at once")
        summary = _result(ref)
        if on_step is not None:
            for row in tail.new_rows():
                on_step(row)
        if summary["reason"] == "interrupted":
            raise RunInterrupted(summary)
        return summary
    finally:
        if controller is not None:
            kill_and_wait([controller])
        args.trainer.shutdown()

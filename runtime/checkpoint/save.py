"""`Checkpointer`: the run's checkpoints, saved by one object.

A checkpoint is the policy files (every worker writes its share), the loader states (every
owner returns its pickled state), the config and ``training_info.json``. Everything goes
into ``tmp_step_<N>`` first; `CheckpointDir.commit` fsyncs and renames it, so a crash at any
moment leaves either a complete ``step_<N>`` or a stale temp directory that the next start
removes.

`Checkpointer.save` does it in one call. The controller uses the same two halves on their
own (`begin` sends the workers' writes, `CheckpointWrite.complete` waits and commits) so it
can queue the next step behind the workers' writes in between: the workers go on training
while the controller finishes the directory. The loader states are the controller's to take
(`_loader_state_dicts`) and are handed to `complete`: it sends their calls before `begin`,
and Ray runs an actor's calls in the order they were sent, so each state is read before the
writes and the step queued behind them, with no round trip between them.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sft_runtime.events import CheckpointSaved
from sft_runtime.runtime.checkpoint.config import CheckpointingConfig
from sft_runtime.runtime.checkpoint.loader_states import dumps_loader_states
from sft_runtime.runtime.checkpoint.recorded import record_path
from sft_runtime.runtime.checkpoint.store import LOADERS_NAME, CheckpointDir
from sft_runtime.runtime.errors import UserInputError, quietly
from sft_runtime.runtime.process.disk_full import FULL_ERRNOS, error_chain
from sft_runtime.runtime.process.faults import fault_point
from sft_runtime.states import SFTV2SaveState
from sft_runtime.states.fold import checkpoint_saved_event

CHECKPOINT_FORMAT = 1
IDENTITIES_INFO_KEY = "input_identities"  # in training_info.json: see `Checkpointer`


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, say): the run stops, nothing saved is lost.
    ``written`` names the checkpoint (`disk_full_error` reports it as what was written)."""

    def __init__(self, code: int | None, message: str, written: str = "") -> None:
        super().__init__(code, message)
        self.written = written

    def __reduce__(self):  # the name of the checkpoint crosses Ray with it
        return (type(self), (self.errno, self.strerror, self.written))


def state_metric(
    metric_name: str | None, metrics: dict[str, Any], val_metrics: dict[str, Any] | None = None
) -> dict[str, float]:
    """``{metric_name: value}`` from a step's metrics (``{}`` without a name), keyed the way
    the reference keys its checkpoint metrics (``train:<key>``); unknown keys list the known.
    A ``val:<key>`` name reads the latest validation's metrics (``{}`` before the first)."""
    if metric_name is None:
        return {}
    if metric_name.startswith("val:"):
        key = metric_name.removeprefix("val:")
        return {metric_name: float(val_metrics[key])} if val_metrics else {}
    key = metric_name.removeprefix("train:")
    if key not in metrics:
        known = ", ".join(f"train:{k}" for k in sorted(metrics))
        raise UserInputError(
            f"checkpointing.metric_name {metric_name!r} is not a training metric; "
            f"available: {known}"
        )
    return {metric_name: float(metrics[key])}


class Checkpointer:
    """One run's checkpoints: where they go, what they record, how they are written."""

    def __init__(
        self,
        section: CheckpointingConfig,
        group: Any,
        store: CheckpointDir,
        *,
        run_config: dict[str, Any],
        num_threads: int,
        identities: dict[str, str] | None = None,
    ) -> None:
        """``run_config``: the whole run config as plain data (each checkpoint keeps a
        copy; its ``logger.log_dir`` is the run directory that `checkpoint_saved` records
        the checkpoint's folder against); ``num_threads``: the workers' torch threads (a
        bitwise resume needs them); ``identities``: what the config's paths hold (the data
        set's, the model's and the tokenizer's content digests), so a resume can tell a
        moved input from a changed one."""
        self.section = section
        self.group = group
        self.store = store
        self.num_threads = num_threads
        self.run_dir = (run_config.get("logger") or {}).get("log_dir")
        self._config_yaml = config_yaml(run_config)  # ~2 ms: once a run
        self._identities = dict(identities or {})

    def metric(
        self, metrics: dict[str, Any], val_metrics: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """``{"train:<name>": value}`` (or ``val:<name>``) checkpoints are ranked by; an
        unknown name fails at the first step."""
        return state_metric(self.section.metric_name, metrics, val_metrics)

    def begin(
        self,
        state: SFTV2SaveState,
        *,
        kinds: tuple[str, ...],
        metric: dict[str, float],
        attempt: int | None,
        final: bool,
        carrier: dict | None = None,
    ) -> CheckpointWrite:
        """Open ``tmp_step_<N>`` and send every worker its share of the policy files
        (weights, optimizer, RNG, tokenizer)."""
        tmp = self.store.begin(state.total_steps)
        try:
            policy = tmp / "policy"
            optimizer = policy / "optimizer" if self.section.save_optimizer else None
            files = self.group.send_save(
                str(policy / "weights"),
                None if optimizer is None else str(optimizer),
                final=final,
                rng_path=str(policy / "rng"),
                tokenizer_path=str(policy / "tokenizer"),
                background=self.section.background_writes,
                carrier=carrier,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return CheckpointWrite(self, state, tmp, files, self._info(kinds, metric, attempt))

    def _info(
        self, kinds: tuple[str, ...], metric: dict[str, float], attempt: int | None
    ) -> dict[str, Any]:
        return {
            "kinds": list(kinds),
            **metric,  # "train:<name>": value, as the reference's training_info has it
            "metric_name": self.section.metric_name,
            "metric": next(iter(metric.values()), None),
            "attempt": attempt,
            "num_threads_per_worker": self.num_threads,
            IDENTITIES_INFO_KEY: self._identities,
        }

    def prune(self) -> list[int]:
        """Apply the retention rules; returns the steps removed."""
        return self.store.prune()


@dataclass
class CheckpointWrite:
    """A checkpoint whose workers' calls are sent; `complete` finishes it (or nothing of it
    is left), `discard` gives it up."""

    owner: Checkpointer
    state: SFTV2SaveState
    tmp: Path
    wave: Any  # the workers' writes (`Pending`)
    info: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)

    def describe(
        self, state: SFTV2SaveState, *, kinds: tuple[str, ...], metric: dict[str, float]
    ) -> None:
        """What the checkpoint records, for writes sent before their step was recorded (the
        state, and the metric it is ranked by, are known only then)."""
        if state.total_steps != self.state.total_steps:
            raise RuntimeError(
                f"checkpoint of step {self.state.total_steps} described as step {state.total_steps}"
            )
        self.state = state
        self.info = self.owner._info(kinds, metric, self.info["attempt"])

    def complete(self, loader_states: list[bytes]) -> CheckpointSaved:
        """Wait for the workers, write the rest (``loader_states``: the owners' pickled
        states at this step), fsync and rename; the event to record."""
        store, step, attempt = self.owner.store, self.state.total_steps, self.info["attempt"]
        try:
            self.owner.group.wait(self.wave)
            fault_point("saving:after_weights", step=step, attempt=attempt)
            (self.tmp / LOADERS_NAME).write_bytes(dumps_loader_states(loader_states))
            (self.tmp / "config.yaml").write_text(self.owner._config_yaml)
            full_info = {
                "format": CHECKPOINT_FORMAT,
                "step": step,
                "save_state": self.state.to_dict(),
                "logical_world_size": len(loader_states),
                "time": time.time(),
                **self.info,
            }
            fault_point("saving:before_rename", step=step, attempt=attempt)
            final = store.commit(step, self.tmp, full_info)
            fault_point("saving:after_rename", step=step, attempt=attempt)
        except BaseException as exc:
            self._remove_tmp(settle=isinstance(exc, Exception))
            # a worker's refused write arrives wrapped (`PolicyWorkerError`): found the same
            refused = exc if isinstance(exc, OSError) else _refused_write(exc)
            if refused is None:
                raise
            raise CheckpointWriteError(
                refused.errno,
                f"could not write checkpoint {store.path(step)} ({refused.strerror or refused}); "
                "the previous checkpoints and the event log are unchanged",
                written=f"checkpoint {store.path(step)}",
            ) from exc
        seconds = time.perf_counter() - self.started
        recorded = record_path(final, self.owner.run_dir)  # the tools find it from the log
        return checkpoint_saved_event(self.state, recorded, self.info["metric"], seconds)

    def _remove_tmp(self, *, settle: bool) -> None:
        """Remove the temporary folder; with ``settle``, once the workers' writes into it
        ended (a rank still writing when another failed would put files back in it)."""
        if settle:
            wave, group = self.wave, self.owner.group
            quietly("wait for the workers' writes", lambda: group.settle(wave, DISCARD_WAIT_S))
        shutil.rmtree(self.tmp, ignore_errors=True)

    def discard(self) -> None:
        """Give the checkpoint up: wait (errors ignored) for the workers, drop the files."""
        self.owner.group.settle(self.wave, DISCARD_WAIT_S)
        shutil.rmtree(self.tmp, ignore_errors=True)


DISCARD_WAIT_S = 30.0


def _refused_write(exc: BaseException) -> OSError | None:
    """The write refused for space or quota somewhere inside ``exc`` (a worker's), if any."""
    return next(
        (e for e in error_chain(exc) if isinstance(e, OSError) and e.errno in FULL_ERRNOS), None
    )


def config_yaml(config: dict[str, Any]) -> str:
    """The run's config as written into every checkpoint (render once per run: ~2 ms)."""
    return yaml.safe_dump(config, sort_keys=False)

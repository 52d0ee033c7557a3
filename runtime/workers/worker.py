"""`PolicyWorkerBase`: one data-parallel replica and its loader, inside a worker actor.

One per DP rank, built by the Ray actor `runtime.workers.actor.PolicyWorker`, which hands it
every call. The batch a rank trains on is built by its own colocated loader
(a `BatchSource` made from a picklable zero-arg factory) and never leaves the process; the
controller only sees `StepEnvelope`s and the frozen records of `runtime.workers.results`.

Lifecycle, driven by `PolicyWorkerGroup`: the constructor pins the torch thread count,
seeds python/numpy/torch (``seed + rank``) and builds the model from ``seed`` alone (the
same initial weights on every rank); `rendezvous_address` on rank 0 returns its node IP and
a free port; `init_distributed` on every rank then joins torch.distributed (gloo on CPU,
NCCL with a GPU, both with a GPU and ``cpu_offload``: `rendezvous.backend`) with an explicit
timeout, so a rank that never arrives fails the group instead of hanging for gloo's default
30 minutes.

One training step has three phases (see `runtime.policy.replica`): begin (collective:
the global token count), train (local forward/backward) and finish (collective: gradients,
clip, AdamW). The controller drives a step in one call, `train_sft_step`, which runs its two
halves: `start_sft_step` (commit the previous batch, load, begin, train) and
`finish_train_step`. Each half is a call of its own too (the benchmarks and tests drive a
step in halves), and a start left open is undone by `abort_train_step` + `abort_sft_batch`.
The loader is a `WorkerLoader` of its own (`worker_loader`). Every method accepts
``_otel_carrier`` (a W3C carrier dict: the worker's spans join the caller's trace).
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from sft_runtime.runtime.data.batch import BatchSource
from sft_runtime.runtime.data.prefetch import PrefetchingLoader
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy import rendezvous
from sft_runtime.runtime.policy.cluster_config import ClusterConfig
from sft_runtime.runtime.policy.config import PolicyConfig
from sft_runtime.runtime.policy.replica import Replica
from sft_runtime.runtime.policy.step_outcome import StepFinished, StepUndone
from sft_runtime.runtime.process.faults import fault_point
from sft_runtime.runtime.process.niceness import set_niceness
from sft_runtime.runtime.process.step_census import step_census
from sft_runtime.runtime.workers.results import (
    CheckpointFiles,
    CheckpointLoaded,
    StepStarted,
    StepTrained,
    ValidationResult,
)
from sft_runtime.runtime.workers.worker_loader import WorkerLoader
from sft_runtime.runtime.workers.worker_state import WorkerState
from sft_runtime.states.machine import StepPhase
from sft_runtime.traces.spans import (
    BEGIN_STEP_SPAN,
    FINISH_STEP_SPAN,
    FORWARD_BACKWARD_SPAN,
    LOAD_SPAN,
    PHASE_ATTR,
    READ_AHEAD_SPAN,
    START_STEP_SPAN,
    VALIDATION_WORKER_SPAN,
    traced,
)


class PolicyWorkerBase:
    """The worker's logic; `runtime.workers.actor.PolicyWorker` is its Ray actor class."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        policy: PolicyConfig,
        cluster: ClusterConfig,
        seed: int = 0,
    ) -> None:
        if cluster.gpus_per_worker and not torch.cuda.is_available():
            raise UserInputError(_no_cuda_message(cluster.gpus_per_node))
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self.cluster = cluster
        self.num_threads = cluster.num_threads_per_worker
        set_niceness(cluster.worker_niceness)
        torch.set_num_threads(self.num_threads)
        try:
            torch.set_num_interop_threads(self.num_threads)
        except RuntimeError:
            pass  # already set once in this process; intra-op threads are what matter
        random.seed(seed + rank)
        np.random.seed(seed + rank)
        torch.manual_seed(seed + rank)
        self.has_gpu = bool(cluster.gpus_per_worker)
        self.device = torch.device("cuda", 0) if self.has_gpu else torch.device("cpu")
        # the rendezvous rank 0 serves until it joins (torch exports TCPStore without saying so)
        self._store: dist.TCPStore | None = None  # pyright: ignore[reportPrivateImportUsage]
        if self.has_gpu:
            torch.cuda.set_device(self.device)
        self.replica = Replica(policy, seed=seed, device=self.device)
        self.state = WorkerState(
            self.replica, policy, rank=rank, world_size=world_size, num_threads=self.num_threads
        )
        self.loader = WorkerLoader(rank, self.replica, self._attrs)
        self._validation: Any = None  # this rank's `ValidationShare`, rendered once

    # ----------------------------------------------------------------- distributed
    def rendezvous_address(self, *, _otel_carrier: dict | None = None) -> tuple[str, int]:
        """This node's IP and the port of the rendezvous store this rank (0) now serves."""
        self._store = rendezvous.serve(self.cluster.dist_timeout_s)
        return ray.util.get_node_ip_address(), int(self._store.port)

    def init_distributed(
        self, master_addr: str, master_port: int, *, _otel_carrier: dict | None = None
    ) -> dict[str, Any]:
        """Join the process group of all DP ranks; fails after ``cluster.dist_timeout_s``."""
        backend = rendezvous.backend(self.has_gpu, cpu_offload=self.policy.dtensor_cfg.cpu_offload)
        store, self._store = self._store, None  # the process group keeps it from here on
        rendezvous.join(
            backend,
            self.rank,
            self.world_size,
            host=master_addr,
            port=master_port,
            timeout_s=self.cluster.dist_timeout_s,
            store=store,
        )
        if self.policy.dtensor_cfg.enabled:
            self.replica.shard(self.world_size)
        return {"rank": self.rank, "backend": backend, "sharded": self.replica.sharded}

    def setup_telemetry(
        self, config: Any, run_dir: str | None, attempt: int | None = None, **_: Any
    ) -> bool:
        """Install this process's exporters (once per process; no-op when disabled)."""
        from sft_runtime.traces.setup import setup_telemetry

        node = ray.get_runtime_context().get_node_id()
        self._telemetry = setup_telemetry(
            config, role="worker", rank=self.rank, attempt=attempt, run_dir=run_dir, node=node
        )
        return self._telemetry.enabled

    def flush_telemetry(self, deadline: float | None = None, **_: Any) -> bool:
        """Export buffered spans now (an actor killed later runs no exit hooks), by the run's
        shutdown ``deadline`` (unix seconds)."""
        telemetry = getattr(self, "_telemetry", None)
        return True if telemetry is None else telemetry.force_flush(deadline=deadline)

    def _attrs(self, phase: StepPhase) -> dict[str, Any]:
        """A step span's attributes: this rank and the step phase the span belongs to."""
        return {"rank": self.rank, PHASE_ATTR: phase.value}

    def node_id(self, *, _otel_carrier: dict | None = None) -> str:
        return ray.get_runtime_context().get_node_id()

    def ping(self, *, _otel_carrier: dict | None = None) -> int:
        return self.rank

    def probe(self, look: Callable[[PolicyWorkerBase], Any], *, _otel_carrier=None) -> Any:
        """``look(self)``: what a test or a benchmark reads off a worker (its weights, its
        memory; `tests/support/worker_probes.py`). Never part of a run."""
        return look(self)

    def validate(self, spec: Any, *, _otel_carrier: dict | None = None) -> ValidationResult:
        """This rank's share of a validation pass (`ValidationSpec`) under the current
        weights: summed NLL, supervised tokens, samples, and the ids of its samples. The
        share is read and rendered at the first pass and kept; no RNG is consumed."""
        from sft_runtime.runtime.policy.evaluate import evaluate, rng_untouched
        from sft_runtime.runtime.validation.samples import ValidationShare

        t0 = time.perf_counter()
        with traced(VALIDATION_WORKER_SPAN, carrier=_otel_carrier, attributes={"rank": self.rank}):
            with rng_untouched(self.device):
                error: Exception | None = None
                share = self._validation
                try:
                    if share is None or share.spec != spec:
                        share = self._validation = ValidationShare(spec, self.rank, self.world_size)
                    batches = share.micro_batches()
                except Exception as exc:  # noqa: BLE001 - raised once the ranks agreed
                    error, batches = exc, []
                nll, tokens = evaluate(self.replica, batches, error)
        assert share is not None  # else `evaluate` raised the error that left it unset
        return ValidationResult(
            nll_sum=nll,
            tokens=tokens,
            samples=share.samples,
            total=share.total,
            source_ids=share.source_ids,
            seconds=time.perf_counter() - t0,
        )

    # ----------------------------------------------------------------- loader (`WorkerLoader`)
    def setup_sft_dataloader(
        self,
        factory: Callable[[], BatchSource],
        restored_state: dict | bytes | list | None = None,
        prefetch_depth: int = 1,
        *,
        load_during_allreduce: bool = False,
        _otel_carrier: dict | None = None,
    ) -> None:
        self.loader.setup(factory, restored_state, prefetch_depth, load_during_allreduce)

    def commit_sft_batch(self, *, _otel_carrier: dict | None = None) -> None:
        self.loader.commit(_otel_carrier)

    def abort_sft_batch(self, *, _otel_carrier: dict | None = None) -> None:
        self.loader.abort()

    def sft_dataloader_state_bytes(
        self, commit_first: bool = False, *, _otel_carrier: dict | None = None
    ) -> list[bytes]:
        """The state of each shard this rank loads, pickled here: the controller writes
        them without unpickling them. With ``commit_first`` the last step's batch is
        committed first (a checkpoint needs both, and one call saves a hand-over while the
        worker waits), if (and only if) that step finished here, as a start's
        ``commit_previous``: a save sent before its step was recorded fails instead when the
        step did not finish."""
        return self.loader.state_bytes(commit_first, _otel_carrier)

    def close_sft_dataloader(self, *, _otel_carrier: dict | None = None) -> None:
        self.loader.close()

    # ----------------------------------------------------------------- training
    def prepare_for_training(self, *, _otel_carrier: dict | None = None) -> None:
        self.replica.model.train()

    def finish_train_step(self, *, _otel_carrier: dict | None = None) -> StepFinished:
        """All-reduce gradients, clip, step AdamW and the LR schedule; the step's metrics."""
        fault_point("worker:finish", step=self.replica.steps_done + 1, rank=self.rank)
        with traced(
            FINISH_STEP_SPAN, carrier=_otel_carrier, attributes=self._attrs(StepPhase.train)
        ):
            self.state.writes.wait_copied()  # a checkpoint being written still reads the weights
            read_ahead = self._read_ahead if self.loader.reads_ahead_in_finish else None
            return self.replica.finish(read_ahead)

    def train_sft_step(
        self,
        loss_fn: Any = None,
        commit_previous: bool = False,
        *,
        sent_ahead: bool = False,
        _otel_carrier: dict | None = None,
        finish_carrier: dict | None = None,
    ) -> StepTrained:
        """A whole step in one call: `start_sft_step`, then `finish_train_step` (under
        ``finish_carrier``). One call a step is one hand-over from Ray a step, not two: on a
        machine whose cores the workers fill, each costs the controller and the worker CPU
        that the next step waits for. A start that fails raises before the finish runs, so
        the step stays open to be aborted, as with the two calls."""
        with step_census(f"worker{self.rank}", self.replica.steps_done + 1):
            started = self.start_sft_step(
                loss_fn, commit_previous, sent_ahead=sent_ahead, _otel_carrier=_otel_carrier
            )
            return StepTrained(started, self.finish_train_step(_otel_carrier=finish_carrier))

    def _read_ahead(self) -> None:
        """The next step's batch, read while this step's gradients are all-reduced: the
        one stretch of the step in which this thread only waits for its peers."""
        loader = self.loader.require()
        if not isinstance(loader, PrefetchingLoader):  # `reads_ahead_in_finish` made it one
            raise RuntimeError(f"rank {self.rank}: the loader does not read ahead")
        with traced(READ_AHEAD_SPAN, attributes={"rank": self.rank}):
            loader.fetch_now()

    def start_sft_step(
        self,
        loss_fn: Any = None,
        commit_previous: bool = False,
        *,
        sent_ahead: bool = False,
        _otel_carrier: dict | None = None,
    ) -> StepStarted:
        """A step up to its gradients, in one call: commit the previous batch, load, begin, train.

        `finish_train_step` (the gradient all-reduce and the optimizer) is the step's second
        call. The controller queues the next step's start behind this step's finish, so a
        worker goes from one step to the next without waiting for the controller; everything
        a start does can be undone by `abort_train_step` + `abort_sft_batch` (no weight or
        optimizer change, RNG rewound). ``commit_previous`` commits the batch of the step
        before only if that step finished here; otherwise this call fails.

        A phase that fails still lets this rank join `begin`'s collective with an error flag,
        so every rank fails at once instead of waiting for the process-group timeout (a failed
        train makes the queued `finish` refuse on every rank). The error is raised with
        ``sft_phase`` (a `StepPhase`: loading or train) set, which the controller records in
        ``step_aborted``. ``started_ns`` in the result is when this call began: where the
        step's trace starts when the call was sent ahead and queued here behind the previous
        step.
        """
        started_ns = time.time_ns()
        attrs = {"rank": self.rank, "sft.sent_ahead": sent_ahead}
        with traced(
            START_STEP_SPAN, carrier=_otel_carrier, attributes=attrs, start_time=started_ns
        ):
            return self._start_step(loss_fn, commit_previous, started_ns)

    def _start_step(self, loss_fn: Any, commit_previous: bool, started_ns: int) -> StepStarted:
        before_begin: Exception | None = None
        try:
            if commit_previous:
                self.loader.commit_finished()
            with traced(LOAD_SPAN, attributes=self._attrs(StepPhase.loading)):
                envelope = self.loader.load()
        except Exception as exc:  # noqa: BLE001 - raised after the collective below
            before_begin = exc

        def active_batch() -> Any:
            if before_begin is not None:
                raise before_begin
            return self.loader.active_batch()

        t0 = time.perf_counter()
        try:
            with traced(BEGIN_STEP_SPAN, attributes=self._attrs(StepPhase.train)):
                self.replica.begin(loss_fn, active_batch)
        except Exception as exc:
            phase = StepPhase.loading if before_begin else StepPhase.train
            raise _in_phase(before_begin or exc, phase) from None
        begin_s = time.perf_counter() - t0
        try:
            forward_backward_s = self._train()
        except Exception as exc:
            raise _in_phase(exc, StepPhase.train) from None
        return StepStarted(envelope, begin_s, forward_backward_s, started_ns)

    def _train(self) -> float:
        """Forward/backward on the batch `begin` counted (gradient accumulation); seconds."""
        error: Exception | None = None
        try:  # sharded, the other ranks must hear of a failure before their forward
            fault_point("worker:train", step=self.replica.steps_done + 1, rank=self.rank)
        except Exception as exc:  # noqa: BLE001 - raised by `train` after the ranks agree
            error = exc
        with traced(FORWARD_BACKWARD_SPAN, attributes=self._attrs(StepPhase.train)):
            return self.replica.train(error=error)["forward_backward_s"]

    def abort_train_step(self, *, _otel_carrier: dict | None = None) -> StepUndone:
        """Drop the open step's gradients; weights and optimizer stay bitwise unchanged."""
        return self.replica.abort()

    # ----------------------------------------------------------------- state (`WorkerState`)
    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        is_final_checkpoint: bool = False,
        *,
        rng_path: str | None = None,
        _otel_carrier: dict | None = None,
    ) -> CheckpointFiles:
        return self.state.save_checkpoint(
            weights_path, optimizer_path, tokenizer_path, is_final_checkpoint, rng_path=rng_path
        )

    def begin_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        is_final_checkpoint: bool = False,
        *,
        rng_path: str | None = None,
        _otel_carrier: dict | None = None,
    ) -> CheckpointFiles:
        return self.state.begin_checkpoint(
            weights_path, optimizer_path, tokenizer_path, is_final_checkpoint, rng_path=rng_path
        )

    def checkpoint_written(
        self, weights_path: str, *, _otel_carrier: dict | None = None
    ) -> CheckpointFiles:
        return self.state.checkpoint_written(weights_path)

    def load_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        *,
        rng_path: str | None = None,
        allow_thread_change: bool = False,
        reseed_rng: bool = False,
        _otel_carrier: dict | None = None,
    ) -> CheckpointLoaded:
        return self.state.load_checkpoint(
            weights_path,
            optimizer_path,
            rng_path=rng_path,
            allow_thread_change=allow_thread_change,
            reseed_rng=reseed_rng,
        )


def _no_cuda_message(gpus_per_node: int) -> str:
    """Why a worker that was given a GPU cannot use it, and what to change."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    build = torch.version.cuda or "none (a CPU-only build)"
    return (
        f"cluster.gpus_per_node={gpus_per_node}, but torch on {socket.gethostname()} sees no "
        f"CUDA device (CUDA_VISIBLE_DEVICES={visible}, torch {torch.__version__}, CUDA {build}); "
        "install a CUDA build of torch on every node or set cluster.gpus_per_node: 0"
    )


def _in_phase(exc: Exception, phase: StepPhase) -> Exception:
    """Tag an error with the step phase it happened in (pickled with it across Ray)."""
    setattr(exc, "sft_phase", phase.value)  # noqa: B010 - an attribute Exception does not declare
    return exc

"""`PolicyWorkerGroup`: the driver-side handle on the data-parallel policy workers.

It reserves a placement group (one bundle per worker), starts one `PolicyWorker` per DP
rank, wires them into one torch.distributed group, and fans the typed calls of
`WorkerCalls` out to them: submit to every target worker, then wait on all results at once
with one deadline. Results come back in rank order. The first failure is raised at once as
a `PolicyWorkerError` naming the rank(s) and method (a dead actor says so), and a call that
has not finished by the deadline raises too, so a dead or stuck worker never hangs the
caller.

`shutdown` kills the actors and removes the placement group; it is idempotent and works on
a half-built group, so constructors and controllers can always call it on the way out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sft_runtime.runtime.data.batch import BatchSource
from sft_runtime.runtime.errors import PeerStepError, UserInputError
from sft_runtime.runtime.policy.cluster_config import ClusterConfig
from sft_runtime.runtime.policy.config import PolicyConfig, check_batch_layout, parse_section
from sft_runtime.runtime.policy.step_outcome import StepUndone
from sft_runtime.runtime.process.faults import actor_fault_options
from sft_runtime.runtime.workers.actor import POLICY_WORKER
from sft_runtime.runtime.workers.actor_exit import kill_and_wait
from sft_runtime.runtime.workers.cluster import (
    create_placement_group,
    remove_placement_group_quietly,
)
from sft_runtime.runtime.workers.results import (
    CheckpointFiles,
    CheckpointLoaded,
    ValidationResult,
)
from sft_runtime.states.machine import earliest

__all__ = [
    "CheckpointLoad",
    "Pending",
    "PolicyWorkerError",
    "PolicyWorkerGroup",
    "PolicyWorkerInputError",
    "Ranks",
    "WorkerCalls",
]


class PolicyWorkerError(RuntimeError):
    """A fanned-out call failed (or timed out) on one or more workers."""

    def __init__(self, message: str, ranks: list[int], phase: str | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.phase = phase  # the earliest step phase a worker reported ("loading", "train")

    def __reduce__(self):  # crosses Ray from the controller to the driver intact
        return (type(self), (str(self), self.ranks, self.phase))


class PolicyWorkerInputError(PolicyWorkerError, UserInputError):
    """A worker refused bad user input (a config value, a checkpoint): CLI exit code 2."""


# ---------------------------------------------------------------------- the typed calls
# `WorkerCalls`: every call the runtime makes on its policy workers, as a typed method.
#
# A group fans each call out to its workers. How it does that is three private primitives
# (`_submit`, `_wait`, `_settle`): `PolicyWorkerGroup` implements them with Ray, a test's
# stand-in with a script. Everything else calls the methods below, so a worker method is
# named in one place and a misspelt call fails when the code is read, not mid-run.
#
# ``send_*`` methods return `Pending` at once (the calls run while the caller goes on; Ray
# runs an actor's calls in the order they were sent); the others wait for every result and
# return them in rank order. ``carrier`` is the W3C trace context the workers' spans join.


Ranks = Literal["all", "owners"] | Sequence[int]


class _CheckpointWeights(TypedDict):
    weights_path: str


class CheckpointLoad(_CheckpointWeights, total=False):
    """`WorkerCalls.load_checkpoint`'s keywords: the checkpoint a group starts from."""

    optimizer_path: str | None
    rng_path: str | None
    allow_thread_change: bool
    reseed_rng: bool


@dataclass
class Pending:
    """Calls sent to workers whose results are not read yet (``method`` names them in
    errors); ``a + b`` waits on both as one."""

    method: str
    refs: list[tuple[int, Any]] = field(default_factory=list)

    def __add__(self, other: Pending) -> Pending:
        return Pending(self.method, self.refs + other.refs)

    def __len__(self) -> int:
        return len(self.refs)


class WorkerCalls:
    """The typed calls, over the three primitives a group provides."""

    owner_ranks: list[int]

    # ------------------------------------------------------------ primitives (per group)
    def _submit(
        self,
        method: str,
        *args: Any,
        ranks: Ranks = "all",
        per_rank_args: Sequence[Sequence[Any]] | None = None,
        **kwargs: Any,
    ) -> Pending:
        raise NotImplementedError

    def _wait(self, pending: Pending, timeout_s: float | None = None) -> list[Any]:
        raise NotImplementedError

    def _settle(self, pending: Pending, timeout_s: float) -> None:
        raise NotImplementedError

    def _run(self, method: str, *args: Any, timeout_s: float | None = None, **kw: Any) -> list:
        return self._wait(self._submit(method, *args, **kw), timeout_s)

    # ------------------------------------------------------------ results of sent calls
    def wait(self, pending: Pending, timeout_s: float | None = None) -> list[Any]:
        """Results in rank order; the first failure, or the deadline, raises."""
        return self._wait(pending, timeout_s)

    def settle(self, pending: Pending, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for calls whose results no longer matter (a failed or
        undone step); their errors are read and dropped."""
        self._settle(pending, timeout_s)

    # ------------------------------------------------------------ one step, sent ahead
    def send_start(
        self,
        loss_fn: Any,
        commit_previous: bool,
        *,
        sent_ahead: bool = False,
        carrier: dict | None = None,
    ) -> Pending:
        """`start_sft_step`: commit the previous batch (if asked), load, begin, forward and
        backward. Its results are `StepStarted` records: each owner's `StepEnvelope` and
        when each call began."""
        return self._submit(
            "start_sft_step",
            loss_fn,
            commit_previous,
            sent_ahead=sent_ahead,
            _otel_carrier=carrier,
        )

    def send_step(
        self,
        loss_fn: Any,
        commit_previous: bool,
        *,
        sent_ahead: bool = False,
        carrier: dict | None = None,
        finish_carrier: dict | None = None,
    ) -> Pending:
        """`train_sft_step`: `send_start` and `send_finish` as one call; its results are
        `StepTrained` records. ``finish_carrier`` is the trace context of the finish."""
        return self._submit(
            "train_sft_step",
            loss_fn,
            commit_previous,
            sent_ahead=sent_ahead,
            _otel_carrier=carrier,
            finish_carrier=finish_carrier,
        )

    def send_finish(self, *, carrier: dict | None = None, ranks: Ranks = "all") -> Pending:
        """`finish_train_step`: gradient all-reduce, clip, optimizer step; its results are
        `StepFinished` records."""
        return self._submit("finish_train_step", ranks=ranks, _otel_carrier=carrier)

    def send_save(
        self,
        weights_path: str,
        optimizer_path: str | None,
        *,
        final: bool,
        rng_path: str,
        tokenizer_path: str | None = None,
        background: bool = False,
        carrier: dict | None = None,
    ) -> Pending:
        """Every worker writes its share of the policy files (rank 0 also the tokenizer).
        With `background`, the workers take what the files hold and write them while the
        next calls run; the calls returned end when the files are written either way (and
        fsynced without `background`: with it, the caller fsyncs the folder, `fsync_tree`)."""
        args = (weights_path, optimizer_path, tokenizer_path, final)
        if not background:
            return self._submit("save_checkpoint", *args, rng_path=rng_path, _otel_carrier=carrier)
        self._submit("begin_checkpoint", *args, rng_path=rng_path, _otel_carrier=carrier)
        return self._submit("checkpoint_written", weights_path, _otel_carrier=carrier)

    # ------------------------------------------------------------ loaders
    def setup_loaders(
        self,
        factories: Sequence[Callable[[], BatchSource]],
        restored_states: Sequence[Any] | None = None,
        prefetch_depth: int = 1,
        *,
        load_during_allreduce: bool = False,
    ) -> None:
        """One picklable factory (and optional restored state) per loader-owner rank;
        ``prefetch_depth`` >= 2 makes every owner read that many batches ahead in a thread,
        ``load_during_allreduce`` the next one while the gradients are all-reduced."""
        states = list(restored_states) if restored_states is not None else [None] * len(factories)
        self._run(
            "setup_sft_dataloader",
            ranks="owners",
            per_rank_args=list(zip(factories, states, strict=True)),
            prefetch_depth=prefetch_depth,
            load_during_allreduce=load_during_allreduce,
        )

    def commit_batches(self, *, carrier: dict | None = None) -> None:
        self._run("commit_sft_batch", ranks="owners", _otel_carrier=carrier)

    def abort_batches(self, *, carrier: dict | None = None) -> None:
        self._run("abort_sft_batch", ranks="owners", _otel_carrier=carrier)

    def send_loader_state_bytes(
        self, commit_first: bool = False, *, carrier: dict | None = None
    ) -> Pending:
        """Each owner's loader state, pickled in the worker, as it stands when the call runs
        (after the calls sent before it, before those sent after it); ``commit_first``
        commits the last recorded step's batch in the same call."""
        return self._submit(
            "sft_dataloader_state_bytes", commit_first, ranks="owners", _otel_carrier=carrier
        )

    def close_loaders(self, *, carrier: dict | None = None) -> None:
        self._run("close_sft_dataloader", ranks="owners", _otel_carrier=carrier)

    # ------------------------------------------------------------ training
    def prepare_for_training(self, *, carrier: dict | None = None) -> None:
        self._run("prepare_for_training", _otel_carrier=carrier)

    def abort_train_step(self, *, carrier: dict | None = None) -> list[StepUndone]:
        """Drop the open step's gradients and rewind its RNG (a no-op when none is open)."""
        return self._run("abort_train_step", _otel_carrier=carrier)

    # ------------------------------------------------------------ state and checkpoints
    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        is_final_checkpoint: bool = False,
        rng_path: str | None = None,
    ) -> list[CheckpointFiles]:
        return self._run(
            "save_checkpoint",
            weights_path,
            optimizer_path,
            tokenizer_path,
            is_final_checkpoint,
            rng_path=rng_path,
        )

    def load_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        rng_path: str | None = None,
        allow_thread_change: bool = False,
        reseed_rng: bool = False,
    ) -> list[CheckpointLoaded]:
        return self._run(
            "load_checkpoint",
            weights_path,
            optimizer_path,
            rng_path=rng_path,
            allow_thread_change=allow_thread_change,
            reseed_rng=reseed_rng,
        )

    # ------------------------------------------------------------ process
    def setup_telemetry(
        self, config: Any, run_dir: str, attempt: int | None, *, carrier: dict | None = None
    ) -> None:
        self._run("setup_telemetry", config, run_dir, attempt, _otel_carrier=carrier)

    def flush_telemetry(
        self, *, deadline: float | None = None, carrier: dict | None = None
    ) -> list[bool]:
        return self._run("flush_telemetry", deadline=deadline, _otel_carrier=carrier)

    def ping(self) -> list[int]:
        return self._run("ping")

    def node_ids(self) -> list[str]:
        return self._run("node_id")

    def validate(self, spec: Any, *, carrier: dict | None = None) -> list[ValidationResult]:
        """Every rank's share of a validation pass (`PolicyWorker.validate`)."""
        return self._run("validate", spec, _otel_carrier=carrier)

    def probe(self, look: Callable[[Any], Any], *, ranks: Ranks = "all") -> list[Any]:
        """``look(worker)`` on each of ``ranks`` (tests and benchmarks only:
        `tests/support/worker_probes.py`)."""
        return self._run("probe", look, ranks=ranks)


class PolicyWorkerGroup(WorkerCalls):
    """One `PolicyWorker` per DP rank, placed by a placement group, joined by gloo/NCCL."""

    def __init__(
        self,
        policy: PolicyConfig | dict,
        cluster: ClusterConfig | dict,
        *,
        seed: int = 0,
        name: str = "",
        restore: CheckpointLoad | None = None,
    ) -> None:
        """Build everything or nothing: on any failure the half-built group is torn down.

        ``restore`` holds `PolicyWorker.load_checkpoint` keywords (``weights_path``,
        ``optimizer_path``, ``rng_path``) to start from a checkpoint.
        """
        self.policy = parse_section(PolicyConfig, policy, "policy")
        self.cluster = parse_section(ClusterConfig, cluster, "cluster")
        self.world_size = self.cluster.world_size
        self.rows_per_rank = check_batch_layout(self.policy, self.world_size)
        self.workers: list[Any] = []
        self.placement_group = None
        self._closed = False
        try:
            self.placement_group = placement = create_placement_group(self.cluster, name=name)
            self._start_workers(placement, seed)
            self.ping()
            addr, port = self._run("rendezvous_address", ranks=[0])[0]
            self._run("init_distributed", addr, port, timeout_s=self.cluster.dist_timeout_s + 30.0)
            if restore is not None:
                self.load_checkpoint(**restore)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, placement: PlacementGroup, seed: int) -> None:
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=placement,
                placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=False,
            )
            actor = POLICY_WORKER.options(
                num_cpus=self.cluster.cpus_per_worker,
                num_gpus=self.cluster.gpus_per_worker,
                scheduling_strategy=strategy,
                max_restarts=0,
                max_task_retries=0,
                **actor_fault_options(),
            ).remote(rank, self.world_size, self.policy, self.cluster, seed)
            self.workers.append(actor)

    # ----------------------------------------------------------------- layout
    @property
    def owner_ranks(self) -> list[int]:
        """Ranks that own a colocated loader: every DP rank (no TP/PP/CP yet)."""
        return list(range(self.world_size))

    def sharding_annotations(self) -> dict[str, int]:
        """Parallel layout for the placement plan, axes in their fixed order."""
        return {
            "data_parallel": self.world_size,
            "tensor_parallel": 1,
            "pipeline_parallel": 1,
            "context_parallel": 1,
        }

    # ----------------------------------------------------------------- fan-out
    def _submit(
        self,
        method: str,
        *args: Any,
        ranks: Ranks = "all",
        per_rank_args: Sequence[Sequence[Any]] | None = None,
        **kwargs: Any,
    ) -> Pending:
        """Start ``method`` on the target workers; (rank, ObjectRef) pairs in rank order.

        ``args``/``kwargs`` go to every target; ``per_rank_args`` (one tuple per target, in
        rank order) are appended after them.
        """
        if self._closed:
            raise PolicyWorkerError(f"{method}: the worker group is shut down", [])
        targets = self._targets(ranks)
        if per_rank_args is not None and len(per_rank_args) != len(targets):
            raise ValueError(
                f"{method}: {len(per_rank_args)} per-rank argument tuples for "
                f"{len(targets)} target ranks {targets}"
            )
        refs = []
        for i, rank in enumerate(targets):
            extra = tuple(per_rank_args[i]) if per_rank_args is not None else ()
            ref = getattr(self.workers[rank], method).remote(*args, *extra, **kwargs)
            refs.append((rank, ref))
        return Pending(method, refs)

    def _wait(self, pending: Pending, timeout_s: float | None = None) -> list[Any]:
        """Results of `_submit` in rank order; the first failure or the deadline raises."""
        method, refs = pending.method, pending.refs
        timeout = self.cluster.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        rank_of = {ref: rank for rank, ref in refs}
        results: dict[Any, Any] = {}
        waiting = [ref for _, ref in refs]
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = sorted(rank_of[r] for r in waiting)
                raise PolicyWorkerError(
                    f"{method} did not finish within {timeout:g}s on rank(s) {stuck} "
                    f"(cluster.call_timeout_s)",
                    stuck,
                )
            done, waiting = ray.wait(waiting, num_returns=1, timeout=left)
            if not done:
                continue
            more, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=0)
            failures = []
            for ref in done + more:
                try:
                    results[ref] = ray.get(ref, timeout=0)
                except GetTimeoutError:  # pragma: no cover - ready refs do not time out
                    waiting.append(ref)
                except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                    failures.append((rank_of[ref], exc))
            if failures:
                failures += _settle(waiting, rank_of, BLAME_GRACE_S)
                raise _failure(method, failures)
        return [results[ref] for _, ref in refs]

    def _settle(self, pending: Pending, timeout_s: float) -> None:
        refs = pending.refs
        _settle([ref for _, ref in refs], {ref: rank for rank, ref in refs}, timeout_s)

    def _targets(self, ranks: Ranks) -> list[int]:
        if ranks == "all":
            return list(range(self.world_size))
        if ranks == "owners":
            return self.owner_ranks
        targets = sorted(set(ranks))
        bad = [r for r in targets if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"ranks {bad} outside 0..{self.world_size - 1}")
        return targets

    # ----------------------------------------------------------------- teardown
    def shutdown(self) -> None:
        """Kill the actors, wait for their processes, and remove the placement group
        (idempotent, never raises)."""
        self._closed = True
        workers, self.workers = self.workers, []
        kill_and_wait(workers)
        pg, self.placement_group = self.placement_group, None
        remove_placement_group_quietly(pg)


BLAME_GRACE_S = 1.0


def _settle(pending: list, rank_of: dict, grace_s: float) -> list[tuple[int, BaseException]]:
    """Failures of calls still pending after a short grace period.

    When a worker dies its peers fail too (a gloo "connection reset"), sometimes first;
    waiting a moment lets the dead actor's own error arrive, so the right rank is blamed.
    """
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    failures = []
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except Exception as exc:  # noqa: BLE001 - collected for the report
            failures.append((rank_of[ref], exc))
    return failures


def _failure(method: str, failures: list[tuple[int, BaseException]]) -> PolicyWorkerError:
    """One error for all failed ranks, dead actors first (they are usually the cause)."""
    failures.sort(key=lambda f: (not isinstance(f[1], RayActorError), _is_peer(f[1]), f[0]))
    parts = []
    for rank, exc in failures:
        if isinstance(exc, RayActorError):
            parts.append(f"rank {rank}: worker died ({type(exc).__name__})")
        else:
            cause = getattr(exc, "cause", None) or exc
            parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
    causes = [getattr(exc, "cause", None) or exc for _, exc in failures]
    own = [c for c in causes if not isinstance(c, PeerStepError)] or causes  # peers follow
    kind = (
        PolicyWorkerInputError
        if all(isinstance(c, UserInputError) for c in own)
        else PolicyWorkerError
    )
    phase = earliest([getattr(c, "sft_phase", None) for c in own])
    ranks = [r for r, _ in failures]
    err = kind(f"{method} failed: " + "; ".join(parts), ranks, phase and phase.value)
    err.__cause__ = failures[0][1]
    return err


def _is_peer(exc: BaseException) -> bool:
    return isinstance(getattr(exc, "cause", None) or exc, PeerStepError)

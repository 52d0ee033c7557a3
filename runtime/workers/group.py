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
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sft_runtime.runtime.errors import PeerStepError, UserInputError
from sft_runtime.runtime.policy.cluster_config import ClusterConfig
from sft_runtime.runtime.policy.config import PolicyConfig, check_batch_layout, parse_section
from sft_runtime.runtime.process.faults import actor_fault_options
from sft_runtime.runtime.process.heap import worker_heap_env
from sft_runtime.runtime.workers.actor import POLICY_WORKER
from sft_runtime.runtime.workers.actor_exit import kill_and_wait
from sft_runtime.runtime.workers.calls import CheckpointLoad, Pending, Ranks, WorkerCalls
from sft_runtime.runtime.workers.cluster import (
    create_placement_group,
    remove_placement_group_quietly,
)
from sft_runtime.states.machine import earliest

__all__ = [
    "PolicyWorkerError",
    "PolicyWorkerGroup",
    "PolicyWorkerInputError",
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
                **actor_fault_options(worker_heap_env()),
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

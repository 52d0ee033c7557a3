"""`WorkerCalls`: every call the runtime makes on its policy workers, as a typed method.

A group fans each call out to its workers. How it does that is three private primitives
(`_submit`, `_wait`, `_settle`): `PolicyWorkerGroup` implements them with Ray, a test's
stand-in with a script. Everything else calls the methods below, so a worker method is
named in one place and a misspelt call fails when the code is read, not mid-run.

``send_*`` methods return `Pending` at once (the calls run while the caller goes on; Ray
runs an actor's calls in the order they were sent); the others wait for every result and
return them in rank order. ``carrier`` is the W3C trace context the workers' spans join.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from sft_runtime.runtime.data.batch import BatchSource
from sft_runtime.runtime.policy.step_outcome import StepUndone
from sft_runtime.runtime.workers.results import (
    CheckpointFiles,
    CheckpointLoaded,
    ValidationResult,
)

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

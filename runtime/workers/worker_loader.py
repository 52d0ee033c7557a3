"""`WorkerLoader`: the colocated loader a policy worker owns, and when its batch commits.

A concern of its own beside the replica: built from the factory the controller sends,
restored, wrapped for read-ahead, committed a batch at a time only once that batch's step
finished on this rank, rewound, and read for checkpoints. The worker holds one and its
Ray methods (`PolicyWorkerBase.setup_sft_dataloader`, ...) call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sft_runtime.runtime.data.batch import BatchSource, SFTBatch, StepEnvelope
from sft_runtime.runtime.policy.replica import Replica
from sft_runtime.states.machine import StepPhase
from sft_runtime.traces.spans import LOADER_COMMIT_SPAN, traced


class WorkerLoader:
    """One rank's loader (see module docstring); ``attrs`` gives a step span's attributes."""

    def __init__(
        self, rank: int, replica: Replica, attrs: Callable[[StepPhase], dict[str, Any]]
    ) -> None:
        self.rank = rank
        self.replica = replica
        self.attrs = attrs
        self.source: BatchSource | None = None
        self.reads_ahead_in_finish = False  # it reads its next batch in `finish_train_step`
        self._batch_step: int | None = None  # replica steps done when the active batch loaded

    def setup(
        self,
        factory: Callable[[], BatchSource],
        restored_state: dict | bytes | list | None,
        prefetch_depth: int,
        load_during_allreduce: bool,
    ) -> None:
        """Build the loader from ``factory()`` and restore its position.

        ``prefetch_depth`` >= 2 (``data_plane.max_partitions``) wraps it in a
        `PrefetchingLoader` that reads up to that many batches ahead in a background thread;
        otherwise ``load_during_allreduce`` wraps it in one that reads the next batch while
        the step's gradients are all-reduced (`finish_train_step`). A loader of several
        data shards (`ShardGroupLoader`) restores from a list, one state per shard.
        """
        if self.source is not None:
            raise RuntimeError(f"rank {self.rank}: the SFT dataloader is already set up")
        from sft_runtime.runtime.checkpoint.loader_states import load_loader_state
        from sft_runtime.runtime.data.prefetch import PrefetchingLoader

        if prefetch_depth > 1:
            loader = PrefetchingLoader(factory, prefetch_depth)
        elif load_during_allreduce:
            loader = PrefetchingLoader(factory, 2, background=False)
        else:
            loader = factory()
        if isinstance(restored_state, list):
            loader.setup([load_loader_state(state) for state in restored_state])
        else:
            loader.setup(load_loader_state(restored_state))
        self.source = loader
        self.reads_ahead_in_finish = prefetch_depth <= 1 and load_during_allreduce

    def require(self) -> BatchSource:
        if self.source is None:
            raise RuntimeError(f"rank {self.rank}: setup_sft_dataloader was not called")
        return self.source

    def load(self) -> StepEnvelope:
        """The next batch, active until committed or aborted."""
        envelope = self.require().load()
        self._batch_step = self.replica.steps_done
        return envelope

    def active_batch(self) -> SFTBatch:
        return self.require().active_batch

    def commit(self, carrier: dict | None = None) -> None:
        with traced(LOADER_COMMIT_SPAN, carrier=carrier, attributes=self.attrs(StepPhase.commit)):
            self.require().commit()
            self._batch_step = None

    def commit_finished(self, carrier: dict | None = None) -> None:
        """Commit the active batch if (and only if) the step trained on it finished here."""
        done = self._batch_step
        if done is not None and (self.replica.step_open or self.replica.steps_done != done + 1):
            raise RuntimeError(
                f"rank {self.rank}: the step trained on the active batch did not finish; "
                "the batch is not committed"
            )
        self.commit(carrier)

    def abort(self) -> None:
        self._batch_step = None
        self.require().abort()

    def state_bytes(self, commit_first: bool, carrier: dict | None) -> list[bytes]:
        """The state of each shard this rank loads, pickled here (see the worker's
        `sft_dataloader_state_bytes`)."""
        from sft_runtime.runtime.checkpoint.loader_states import dump_loader_state
        from sft_runtime.runtime.data.shards import shard_states

        if commit_first:
            self.commit_finished(carrier)
        return [dump_loader_state(s) for s in shard_states(self.require().state_dict())]

    def close(self) -> None:
        source, self.source = self.source, None
        self.reads_ahead_in_finish = False
        if source is not None:
            source.close()

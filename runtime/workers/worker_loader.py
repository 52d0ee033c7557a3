"""`LoaderOwner`: the policy worker's calls on the colocated loader it owns.

A part of `PolicyWorkerBase` (its base class), kept apart because the loader is a concern
of its own: built from the factory the controller sends, restored, committed a batch at a
time only once that batch's step finished here, rewound, and read for checkpoints. The
worker sets every attribute read here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sft_runtime.runtime.data.batch import BatchSource
from sft_runtime.states.step import StepPhase
from sft_runtime.traces.spans import LOADER_COMMIT_SPAN, traced


class LoaderOwner:
    """The loader half of `PolicyWorkerBase`."""

    rank: int
    replica: Any
    _loader: BatchSource | None
    _reads_ahead_in_finish: bool  # the loader reads its next batch in `finish_train_step`
    _batch_step: int | None  # replica steps done when the active batch loaded
    _attrs: Callable[[StepPhase], dict[str, Any]]  # a step span's attributes

    def setup_sft_dataloader(
        self,
        factory: Callable[[], BatchSource],
        restored_state: dict | bytes | list | None = None,
        prefetch_depth: int = 1,
        *,
        load_during_allreduce: bool = False,
        _otel_carrier: dict | None = None,
    ) -> None:
        """Build this rank's loader from ``factory()`` and restore its position.

        ``prefetch_depth`` >= 2 (``data_plane.max_partitions``) wraps it in a
        `PrefetchingLoader` that reads up to that many batches ahead in a background thread;
        otherwise ``load_during_allreduce`` wraps it in one that reads the next batch while
        the step's gradients are all-reduced (`finish_train_step`). A loader of several
        data shards (`ShardGroupLoader`) restores from a list, one state per shard.
        """
        if self._loader is not None:
            raise RuntimeError(f"rank {self.rank}: the SFT dataloader is already set up")
        from sft_runtime.runtime.data.prefetch import PrefetchingLoader

        if prefetch_depth > 1:
            loader = PrefetchingLoader(factory, prefetch_depth)
        elif load_during_allreduce:
            loader = PrefetchingLoader(factory, 2, background=False)
        else:
            loader = factory()
        from sft_runtime.runtime.checkpoint.loader_states import load_loader_state

        if isinstance(restored_state, list):
            loader.setup([load_loader_state(state) for state in restored_state])
        else:
            loader.setup(load_loader_state(restored_state))
        self._loader = loader
        self._reads_ahead_in_finish = prefetch_depth <= 1 and load_during_allreduce

    def commit_sft_batch(self, *, _otel_carrier: dict | None = None) -> None:
        with traced(
            LOADER_COMMIT_SPAN, carrier=_otel_carrier, attributes=self._attrs(StepPhase.commit)
        ):
            self._require_loader().commit()
            self._batch_step = None

    def abort_sft_batch(self, *, _otel_carrier: dict | None = None) -> None:
        self._batch_step = None
        self._require_loader().abort()

    def sft_dataloader_state_dict(self, *, _otel_carrier: dict | None = None) -> dict:
        return self._require_loader().state_dict()

    def sft_dataloader_state_bytes(
        self, commit_first: bool = False, *, _otel_carrier: dict | None = None
    ) -> list[bytes]:
        """The state of each shard this rank loads, pickled here: the controller writes
        them without unpickling them. With
        ``commit_first`` the last step's batch is committed first (a checkpoint needs both,
        and one call saves a hand-over while the worker waits), if (and only if) that step
        finished here, as a start's ``commit_previous``: a save sent before its step was
        recorded fails instead when the step did not finish."""
        from sft_runtime.runtime.checkpoint.loader_states import dump_loader_state
        from sft_runtime.runtime.data.shards import shard_states

        if commit_first:
            self._commit_finished_batch(_otel_carrier)
        return [dump_loader_state(s) for s in shard_states(self._require_loader().state_dict())]

    def close_sft_dataloader(self, *, _otel_carrier: dict | None = None) -> None:
        loader, self._loader = self._loader, None
        self._reads_ahead_in_finish = False
        if loader is not None:
            loader.close()

    def _require_loader(self) -> BatchSource:
        if self._loader is None:
            raise RuntimeError(f"rank {self.rank}: setup_sft_dataloader was not called")
        return self._loader

    def _commit_finished_batch(self, carrier: dict | None = None) -> None:
        done = self._batch_step
        if done is not None and (self.replica.step_open or self.replica.steps_done != done + 1):
            raise RuntimeError(
                f"rank {self.rank}: the step trained on the active batch did not finish; "
                "the batch is not committed"
            )
        self.commit_sft_batch(_otel_carrier=carrier)

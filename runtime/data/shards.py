"""`ShardGroupLoader`: the contiguous block of data shards one data-parallel rank trains on.

With ``data.elastic.shards`` G and W workers, each worker loads G/W shards, and shard v is
exactly the `ColocatedLoader` that logical rank v of G would be (energon's order depends on
rank, world size, worker count and seed, nothing else). So a step's rows are the same on any
W that divides G: resuming on fewer or more workers re-deals whole shards, each with its own
saved state, and no sample is lost or repeated.

Each step the group loads one batch from every shard, in shard order, and trains on their
rows together: the rows are concatenated (padded to the widest) in shard order, so a
micro-batch of ``train_micro_batch_size`` rows never mixes two shards when the shard's rows
are a multiple of it. Every operation (commit, abort, state) applies to each shard, so a
failed step rewinds all of them, and the state is one per shard: the checkpoint keeps G
states whatever W was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from sft_runtime.runtime.data.batch import SFTBatch, StepEnvelope


def concat_batches(batches: Sequence[SFTBatch], pad_id: int) -> SFTBatch:
    """The rows of ``batches`` in order, each padded at its end to the widest batch."""
    import torch

    if len(batches) == 1:
        return batches[0]
    width = max(int(b.input_ids.shape[1]) for b in batches)

    def padded(name: str, fill: float) -> torch.Tensor:
        parts = []
        for batch in batches:
            tensor = getattr(batch, name)
            extra = width - int(tensor.shape[1])
            if extra:
                pad = torch.full((tensor.shape[0], extra), fill, dtype=tensor.dtype)
                tensor = torch.cat([tensor, pad], dim=1)
            parts.append(tensor)
        return torch.cat(parts, dim=0)

    return SFTBatch(
        input_ids=padded("input_ids", pad_id),
        loss_mask=padded("loss_mask", 0),
        position_ids=padded("position_ids", 0),
        segment_ids=padded("segment_ids", -1),
        cu_seqlens=[bounds for b in batches for bounds in b.cu_seqlens],
        source_ids=[i for b in batches for i in b.source_ids],
        sequence_lengths=[n for b in batches for n in b.sequence_lengths],
        overlong_ids=[i for b in batches for i in b.overlong_ids],
        refused_samples=[r for b in batches for r in b.refused_samples],
    )


def merge_envelopes(envelopes: Sequence[StepEnvelope]) -> StepEnvelope:
    """One envelope for a group's step that keeps each shard's own (`StepEnvelope.shards`)."""
    first = envelopes[0]
    return replace(
        first,
        source_ids=[i for e in envelopes for i in e.source_ids],
        sequence_lengths=[n for e in envelopes for n in e.sequence_lengths],
        load_seconds=sum(e.load_seconds for e in envelopes),
        valid_tokens=sum(e.valid_tokens for e in envelopes),
        physical_packs=sum(e.physical_packs for e in envelopes),
        overlong_samples=sum(e.overlong_samples for e in envelopes),
        skipped_samples=sum(e.skipped_samples for e in envelopes),
        shards=tuple(envelopes),
    )


class ShardGroupLoader:
    """G/W `ColocatedLoader` shards behind one `BatchSource` (see module docstring). It has
    the read-ahead extension too (`fetch_ahead`, `activate_fetched`, `state_dict_at`), so
    `PrefetchingLoader` wraps it as it wraps one shard."""

    def __init__(self, shard_factories: Sequence[Callable[[], Any]]) -> None:
        if not shard_factories:
            raise ValueError("a shard group needs at least one shard")
        self.shards = [factory() for factory in shard_factories]
        self._active: SFTBatch | None = None

    @property
    def logical_rank(self) -> int:
        return self.shards[0].logical_rank

    def fingerprint(self) -> dict:
        return {"shards": [shard.fingerprint() for shard in self.shards]}

    def setup(self, restored_state: list[dict] | None = None) -> None:
        """Build every shard, each from its own saved state (one per shard, in order)."""
        states: list[Any] = [None] * len(self.shards)
        if restored_state is not None:
            if not isinstance(restored_state, list) or len(restored_state) != len(self.shards):
                raise ValueError(
                    f"a group of {len(self.shards)} shards restores from one state per shard"
                )
            states = restored_state
        for shard, state in zip(self.shards, states, strict=True):
            shard.setup(state)

    def close(self) -> None:
        self._active = None
        for shard in self.shards:
            shard.close()

    def load(self) -> StepEnvelope:
        envelopes = [shard.load() for shard in self.shards]
        return self._activated(envelopes)

    def fetch_ahead(self) -> tuple[list[Any], list[SFTBatch]]:
        fetched = [shard.fetch_ahead() for shard in self.shards]
        return [state for state, _ in fetched], [batch for _, batch in fetched]

    def activate_fetched(
        self, state_before: list[Any], batch: list[SFTBatch], load_seconds: float
    ) -> StepEnvelope:
        share = load_seconds / len(self.shards)
        envelopes = [
            shard.activate_fetched(state, part, share)
            for shard, state, part in zip(self.shards, state_before, batch, strict=True)
        ]
        return self._activated(envelopes)

    def _activated(self, envelopes: list[StepEnvelope]) -> StepEnvelope:
        pad_id = self.shards[0].pad_id
        self._active = concat_batches([shard.active_batch for shard in self.shards], pad_id)
        return merge_envelopes(envelopes)

    @property
    def active_batch(self) -> SFTBatch:
        if self._active is None:
            raise RuntimeError("no active batch: call load() first")
        return self._active

    def commit(self) -> None:
        self.active_batch  # noqa: B018 - refuses a commit with nothing loaded
        for shard in self.shards:
            shard.commit()
        self._active = None

    def abort(self) -> None:
        self._active = None
        for shard in self.shards:
            shard.abort()

    def state_dict(self) -> list[dict]:
        """One state per shard, in shard order."""
        return [shard.state_dict() for shard in self.shards]

    def state_dict_at(self, energon_state: list[Any]) -> list[dict]:
        return [
            shard.state_dict_at(state)
            for shard, state in zip(self.shards, energon_state, strict=True)
        ]


def shard_states(state: dict | list[dict]) -> list[dict]:
    """A loader's saved state as one state per shard (a single shard's is a dict)."""
    return state if isinstance(state, list) else [state]

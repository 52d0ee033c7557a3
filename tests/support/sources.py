"""A deterministic in-memory `BatchSource` for policy-worker tests and the benchmark.

Batch ``i`` of logical rank ``r`` is a pure function of ``(seed, r, i)``: rows of varied
length with padding, some rows packing two samples, a prompt part that is not supervised.
So a single-process reference can regenerate the exact global batch of any step
(`global_batch`). The state is the index of the next batch to deliver; `abort` leaves it
alone, so the next `load` delivers the same batch again, as energon's rewind does.
"""

from __future__ import annotations

import time

import torch

from sft_runtime.runtime.data.batch import SFTBatch, StepEnvelope

# Shapes the policy tests use (tiny, so the suite fits a 2-core machine).
SEED = 7
ROWS_PER_RANK = 4
SEQ_LEN = 32
VOCAB = 64


def _randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g).item())


def make_batch(
    seed: int, rank: int, index: int, *, rows: int, seq_len: int, vocab_size: int
) -> SFTBatch:
    """The batch of logical rank ``rank`` at position ``index``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + index)
    shape = (rows, seq_len)
    input_ids = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment_ids = torch.full(shape, -1, dtype=torch.long)
    cu_seqlens: list[list[int]] = []
    source_ids: list[str] = []
    lengths: list[int] = []
    for r in range(rows):
        packed = bool(torch.rand(1, generator=g).item() < 0.4)
        if packed:  # two samples, a little padding after them
            total = _randint(g, seq_len - 4, seq_len)
            first = _randint(g, 4, total - 4)
            seg_lens = [first, total - first]
        else:
            seg_lens = [_randint(g, seq_len // 2, seq_len)]
        start = 0
        cu = [0]
        for s, length in enumerate(seg_lens):
            stop = start + length
            input_ids[r, start:stop] = torch.randint(1, vocab_size, (length,), generator=g)
            position_ids[r, start:stop] = torch.arange(length)
            segment_ids[r, start:stop] = s
            prompt = _randint(g, 1, length // 2)
            loss_mask[r, start + prompt : stop] = 1.0
            cu.append(stop)
            source_ids.append(f"r{rank}-b{index}-row{r}-s{s}")
            lengths.append(length)
            start = stop
        cu_seqlens.append(cu)
    return SFTBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        position_ids=position_ids,
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
        source_ids=source_ids,
        sequence_lengths=lengths,
    )


def global_batch(
    seed: int, world_size: int, index: int, *, rows: int, seq_len: int, vocab_size: int
) -> SFTBatch:
    """All logical ranks' batches at ``index`` stacked in rank order (the reference input)."""
    parts = [
        make_batch(seed, r, index, rows=rows, seq_len=seq_len, vocab_size=vocab_size)
        for r in range(world_size)
    ]
    return SFTBatch(
        input_ids=torch.cat([p.input_ids for p in parts]),
        loss_mask=torch.cat([p.loss_mask for p in parts]),
        position_ids=torch.cat([p.position_ids for p in parts]),
        segment_ids=torch.cat([p.segment_ids for p in parts]),
        cu_seqlens=[c for p in parts for c in p.cu_seqlens],
        source_ids=[s for p in parts for s in p.source_ids],
        sequence_lengths=[n for p in parts for n in p.sequence_lengths],
    )


class SyntheticSource:
    """`BatchSource` over `make_batch`; picklable through a `functools.partial`."""

    def __init__(
        self,
        seed: int,
        logical_rank: int,
        logical_world_size: int,
        *,
        rows: int = 4,
        seq_len: int = 32,
        vocab_size: int = 64,
    ) -> None:
        self.seed = seed
        self.rank = logical_rank
        self.world_size = logical_world_size
        self.rows = rows
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.next_index = 0
        self._active: SFTBatch | None = None
        self.closed = False

    def setup(self, restored_state: dict | None = None) -> None:
        if restored_state is not None:
            if restored_state["logical_rank"] != self.rank:
                raise ValueError(f"state of rank {restored_state['logical_rank']} for {self.rank}")
            self.next_index = int(restored_state["next_index"])

    def load(self) -> StepEnvelope:
        if self._active is not None:
            raise RuntimeError("load() while a batch is active: commit or abort it first")
        t0 = time.perf_counter()
        batch = make_batch(
            self.seed,
            self.rank,
            self.next_index,
            rows=self.rows,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
        )
        self._active = batch
        return StepEnvelope(
            logical_rank=self.rank,
            logical_world_size=self.world_size,
            source_ids=batch.source_ids,
            field_names=["input_ids", "loss_mask", "position_ids", "segment_ids"],
            sequence_lengths=batch.sequence_lengths,
            load_seconds=time.perf_counter() - t0,
            valid_tokens=batch.valid_tokens,
            physical_packs=batch.num_rows,
            extra={"index": self.next_index},
        )

    @property
    def active_batch(self) -> SFTBatch:
        if self._active is None:
            raise RuntimeError("no active batch: call load() first")
        return self._active

    def commit(self) -> None:
        self.active_batch  # noqa: B018 - raises when nothing is active
        self._active = None
        self.next_index += 1

    def abort(self) -> None:
        self._active = None

    def state_dict(self) -> dict:
        return {"logical_rank": self.rank, "next_index": self.next_index}

    def close(self) -> None:
        self._active = None
        self.closed = True


class LossFailingOnRank:
    """`NLLLossFn` that raises in the forward pass of one data-parallel rank."""

    def __init__(self, rank: int) -> None:
        from sft_runtime.runtime.policy.loss import NLLLossFn

        self.rank, self.inner = rank, NLLLossFn()

    def valid_tokens(self, batch: SFTBatch) -> int:
        return self.inner.valid_tokens(batch)

    def __call__(self, logits, batch, global_valid_tokens):
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            raise FloatingPointError(f"loss blew up on rank {self.rank}")
        return self.inner(logits, batch, global_valid_tokens)


def _ship_by_value() -> None:
    """Ray workers cannot import the test package: cloudpickle sends this module whole."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_ship_by_value()

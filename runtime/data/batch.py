"""The batch contract between the colocated loader and the policy worker.

A batch is built inside the worker that trains on it, or in one of its loader's energon
worker processes, and never goes further; the controller only sees the `StepEnvelope`. Both
sides import these two types, so this module is the one place the layout of a batch is
written down.

Token layout (the model predicts token t from tokens < t of the same segment):

- ``input_ids[r, t]``: token ids, PAD where ``segment_ids[r, t] == -1``.
- ``loss_mask[r, t]``: 1.0 when token t is a supervised target (an assistant token that is
  not the first token of its segment), else 0.0. The loss at t uses the logits at t - 1.
- ``position_ids[r, t]``: position inside the token's own segment (restarts at 0 for every
  packed sample), 0 on padding.
- ``segment_ids[r, t]``: index of the packed sample inside row r (0, 1, ...), -1 on padding.
  Attention is causal and block-diagonal over segments.
- ``cu_seqlens[r]``: cumulative sequence lengths of row r's segments, ``[0, l0, l0+l1, ...]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the controller imports the envelope without loading torch
    import torch

_TENSORS = ("input_ids", "loss_mask", "position_ids", "segment_ids")


@dataclass
class SFTBatch:
    """One DP rank's share of a global batch, as tensors (rows x seq_len)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: list[list[int]]
    source_ids: list[str]
    sequence_lengths: list[int]
    overlong_ids: list[str] = field(default_factory=list)  # cut or dropped at the limit
    refused_samples: list[tuple[str, str]] = field(default_factory=list)  # (id, message)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def packed(self) -> bool:
        """Whether a row holds more than one sample (read off the host-side lengths, so
        asking costs no device sync)."""
        return any(len(bounds) > 2 for bounds in self.cu_seqlens)

    @property
    def valid_tokens(self) -> int:
        """Supervised target tokens of this batch (the loss normalizer's share)."""
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device) -> SFTBatch:
        """The same batch with its tensors on ``device`` (one copy per tensor, not per
        micro-batch: a copy from pageable host memory waits for the GPU to drain)."""
        return SFTBatch(
            input_ids=self.input_ids.to(device),
            loss_mask=self.loss_mask.to(device),
            position_ids=self.position_ids.to(device),
            segment_ids=self.segment_ids.to(device),
            cu_seqlens=self.cu_seqlens,
            source_ids=self.source_ids,
            sequence_lengths=self.sequence_lengths,
            overlong_ids=self.overlong_ids,
            refused_samples=self.refused_samples,
        )

    def rows(self, start: int, stop: int) -> SFTBatch:
        """Rows [start, stop) as a micro-batch (source ids are kept whole, for bookkeeping)."""
        return SFTBatch(
            input_ids=self.input_ids[start:stop],
            loss_mask=self.loss_mask[start:stop],
            position_ids=self.position_ids[start:stop],
            segment_ids=self.segment_ids[start:stop],
            cu_seqlens=self.cu_seqlens[start:stop],
            source_ids=self.source_ids,
            sequence_lengths=self.sequence_lengths,
            overlong_ids=self.overlong_ids,
            refused_samples=self.refused_samples,
        )

    def take(self, indexes: Sequence[int]) -> SFTBatch:
        """The rows at ``indexes``, in that order (source ids are kept whole, as `rows`
        keeps them). Indexing copies the rows: take them before the batch goes to a device."""
        picked = list(indexes)
        if picked == list(range(self.num_rows)):
            return self
        return SFTBatch(
            input_ids=self.input_ids[picked],
            loss_mask=self.loss_mask[picked],
            position_ids=self.position_ids[picked],
            segment_ids=self.segment_ids[picked],
            cu_seqlens=[self.cu_seqlens[i] for i in picked],
            source_ids=self.source_ids,
            sequence_lengths=self.sequence_lengths,
            overlong_ids=self.overlong_ids,
            refused_samples=self.refused_samples,
        )

    def trimmed(self, multiple: int = 1, round_to: int = 1) -> SFTBatch:
        """The same rows without the columns that are padding in every one of them (the
        longest row rounded up to a multiple of `round_to`, then of `multiple`; the rows'
        ends are read off ``cu_seqlens``, no device sync). A rank's rows are padded once to
        its longest sample, so a micro-batch of short rows would otherwise run its forward
        and backward over columns that hold no token; they carry no loss, so cutting them
        changes what is learned by nothing but rounding, the same way every time."""
        width = int(self.input_ids.shape[1])
        longest = max((bounds[-1] for bounds in self.cu_seqlens), default=0)
        rounded = -(-max(longest, 1) // round_to) * round_to
        keep = min(width, -(-rounded // multiple) * multiple)
        if keep == width:
            return self
        return SFTBatch(
            input_ids=self.input_ids[:, :keep],
            loss_mask=self.loss_mask[:, :keep],
            position_ids=self.position_ids[:, :keep],
            segment_ids=self.segment_ids[:, :keep],
            cu_seqlens=self.cu_seqlens,
            source_ids=self.source_ids,
            sequence_lengths=self.sequence_lengths,
            overlong_ids=self.overlong_ids,
            refused_samples=self.refused_samples,
        )

    def joined(self, multiple: int = 1, round_to: int = 1) -> SFTBatch:
        """The rows' tokens end to end as one row, without the padding at their ends, the
        total rounded up to a multiple of `round_to`, then of `multiple` (one padding
        segment). Packed rows run this way compute no padding position: each sample stays
        its own segment (`packed_attention` keeps it to itself) and the first token of a
        sample is never a target, so no prediction crosses from one row into the next. Only
        rounding separates its loss from the rows'."""
        import torch

        ends = [bounds[-1] for bounds in self.cu_seqlens]
        total = sum(ends)
        rounded = -(-max(total, 1) // round_to) * round_to
        pad = -(-rounded // multiple) * multiple - total
        offsets, cu_seqlens, segments = 0, [0], []
        for r, bounds in enumerate(self.cu_seqlens):
            segments.append(self.segment_ids[r, : ends[r]] + offsets)
            offsets += len(bounds) - 1
            base = cu_seqlens[-1]
            cu_seqlens.extend(base + b for b in bounds[1:])

        def end_to_end(rows: torch.Tensor | list[torch.Tensor], fill: float) -> torch.Tensor:
            parts = [rows[r, :e] for r, e in enumerate(ends)] if torch.is_tensor(rows) else rows
            tail = [torch.full((pad,), fill, dtype=parts[0].dtype, device=parts[0].device)]
            return torch.cat(parts + tail if pad else parts).unsqueeze(0)

        return SFTBatch(
            input_ids=end_to_end(self.input_ids, 0),
            loss_mask=end_to_end(self.loss_mask, 0.0),
            position_ids=end_to_end(self.position_ids, 0),
            segment_ids=end_to_end(segments, -1),
            cu_seqlens=[cu_seqlens],
            source_ids=self.source_ids,
            sequence_lengths=self.sequence_lengths,
            overlong_ids=self.overlong_ids,
            refused_samples=self.refused_samples,
        )


def _reduce_between_processes(batch: SFTBatch) -> tuple[Any, tuple]:
    """How an energon worker process hands a batch to the loader that trains on it: the
    tensors as plain bytes in the message. torch's own path copies each tensor into shared
    memory and then passes its file descriptor over a socket connection with an HMAC
    handshake, per tensor: about 0.5 ms of CPU on each side, in the training process too,
    which is more than the copy through the pipe costs for a batch of token ids."""
    if any(getattr(batch, name).device.type != "cpu" for name in _TENSORS):
        raise TypeError("an SFTBatch on a device is not sent between processes; send it on the CPU")
    arrays = tuple(getattr(batch, name).numpy() for name in _TENSORS)
    lists = (batch.cu_seqlens, batch.source_ids, batch.sequence_lengths)
    return _rebuild, (arrays, *lists, batch.overlong_ids, batch.refused_samples)


def _rebuild(
    arrays: tuple,
    cu_seqlens: list,
    source_ids: list,
    sequence_lengths: list,
    overlong_ids: list,
    refused_samples: list,
) -> SFTBatch:
    import torch

    tensors = dict(zip(_TENSORS, (torch.from_numpy(a) for a in arrays), strict=True))
    return SFTBatch(
        **tensors,
        cu_seqlens=cu_seqlens,
        source_ids=source_ids,
        sequence_lengths=sequence_lengths,
        overlong_ids=overlong_ids,
        refused_samples=refused_samples,
    )


# Only multiprocessing's pickler (the queues of energon's worker processes) takes this path;
# pickle, Ray and torch.save keep the dataclass's own.
ForkingPickler.register(SFTBatch, _reduce_between_processes)


@dataclass(frozen=True)
class StepEnvelope:
    """What the controller learns about a loaded batch: metadata only, never tensors."""

    logical_rank: int
    logical_world_size: int
    source_ids: list[str]
    field_names: list[str]
    sequence_lengths: list[int]
    load_seconds: float
    valid_tokens: int
    physical_packs: int
    extra: dict = field(default_factory=dict)
    overlong_samples: int = 0  # cut or dropped at data.max_input_seq_length
    skipped_samples: int = 0  # refused by the chat template, skipped (data.skip_bad_samples)
    # a worker that loads several data shards (data.elastic.shards): each shard's own
    shards: tuple[StepEnvelope, ...] = ()

    def per_shard(self) -> tuple[StepEnvelope, ...]:
        """The envelope of each shard this one covers, in shard order (itself for one)."""
        return self.shards or (self,)


class BatchSource(Protocol):
    """The colocated loader as the worker sees it (one per logical DP rank)."""

    def setup(self, restored_state: Any = None) -> None:
        """Build, continuing from a saved state: a dict for one shard, a list (one per
        shard) for a `ShardGroupLoader`."""

    def load(self) -> StepEnvelope: ...

    @property
    def active_batch(self) -> SFTBatch: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...

    def state_dict(self) -> dict: ...

    def close(self) -> None: ...

"""The energon task encoder: conversations -> token rows -> `SFTBatch`.

Every stage works on `EncodedChat`, a row made of one or more segments (one per sample), so the
unpacked path (one segment per row) and the packed path (several) share the batching code. The
loss mask follows batch.py: a token is a target when it belongs to a supervised reply and is not
the first token of its segment, so no loss ever reads across a sample boundary.

A sample longer than ``max_input_seq_length`` follows ``data.overlong_samples``: ``mask`` (NeMo
RL's rule, the default) cuts it to the limit and weights it zero, ``truncate`` cuts it and
trains on the supervised tokens that remain, ``drop`` leaves its tokens out. A sample the chat
template refuses is not raised inside energon (where it would end the loader in a traceback
from another process): it travels in the batch as a record of the error, and the loader that
activates the batch stops the run naming it, or, with ``data.skip_bad_samples``, lets it pass.
A dropped or skipped sample keeps its place in the batch as a single zero-weight token, so
every rank's batch keeps its rows and the step's counts (``overlong_samples``,
``skipped_samples``) come out of the same deterministic stream on a resume.

Packing happens within a step: energon delivers this rank's share of the global batch, in
conversations, exactly as without packing, and `SFTTaskEncoder.pack` lays those conversations
out in rows of at most ``max_input_seq_length`` tokens. So ``policy.train_global_batch_size``
counts conversations packed or not (as in NeMo RL), a packed step trains on the same
conversations as the unpacked one, and the loader's state (energon's) is the same either way.
``first_fit_shuffle`` draws from a private `random.Random` seeded by the step's source ids.

Before a conversation is rendered, a ``prompt_file``'s prompt takes its first user message
(chat_format.py); the tokenizer renders it, with the sample's tool definitions where it has
some (chat_format.py), under the ``data.add_bos``, ``add_eos`` and ``add_generation_prompt``
rules (chat_format.py).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch
from megatron.energon import Sample, SkipSample, TaskEncoder, edataclass, stateless

from sft_runtime.runtime.data.batch import SFTBatch
from sft_runtime.runtime.data.chat_format import ChatFormat, with_prompt
from sft_runtime.runtime.data.packing import plan_bins
from sft_runtime.runtime.data.sample import ChatSample
from sft_runtime.runtime.data.tokenizer import ChatTokenizer, apply_chat_template


@edataclass
class EncodedChat(Sample):
    """A row before padding: per segment its source id, token ids and loss mask."""

    source_ids: list
    token_ids: list
    loss_masks: list
    overlong: list = ()  # source ids cut or dropped at the length limit
    refused: list = ()  # [source id, the template's message] of samples it could not render

    @property
    def length(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


def encode_conversation(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, str]],
    *,
    max_length: int,
    only_unmask_final: bool = False,
    chat_format: ChatFormat | None = None,
    prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[float]]:
    """Token ids truncated to `max_length` and the loss mask (targets, first token never)."""
    ids, supervised = apply_chat_template(
        tokenizer,
        with_prompt(messages, prompt),
        only_unmask_final=only_unmask_final,
        chat_format=chat_format,
        tools=tools,
    )
    ids, supervised = ids[:max_length], supervised[:max_length]
    mask = [0.0] + [1.0 if s else 0.0 for s in supervised[1:]]
    return ids, mask


def encode_sample_tokens(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, str]],
    *,
    max_length: int,
    only_unmask_final: bool,
    overlong: str,
    chat_format: ChatFormat | None = None,
    prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[float], bool]:
    """`encode_conversation` under an overlong policy: (ids, loss mask, was it overlong)."""
    ids, supervised = apply_chat_template(
        tokenizer,
        with_prompt(messages, prompt),
        only_unmask_final=only_unmask_final,
        chat_format=chat_format,
        tools=tools,
    )
    too_long = len(ids) > max_length
    if too_long and overlong == "drop":
        return ids[:1], [0.0], True
    ids, supervised = ids[:max_length], supervised[:max_length]
    if too_long and overlong == "mask":
        return ids, [0.0] * len(ids), True
    return ids, [0.0] + [1.0 if s else 0.0 for s in supervised[1:]], too_long


def collate_rows(rows: list[EncodedChat], *, pad_id: int, pad_multiple: int) -> SFTBatch:
    """Pad rows to a common length (a multiple of `pad_multiple`) and build the tensors.

    The rows are written into numpy arrays, which the tensors then share: a batch is built
    for every step, and a torch op per segment and field costs more than the copy itself.
    """
    longest = max(row.length for row in rows)
    width = -(-longest // pad_multiple) * pad_multiple
    shape = (len(rows), width)
    ids_np = np.full(shape, pad_id, dtype=np.int64)
    mask_np = np.zeros(shape, dtype=np.float32)
    positions_np = np.zeros(shape, dtype=np.int64)
    segments_np = np.full(shape, -1, dtype=np.int64)
    cu_seqlens: list[list[int]] = []
    source_ids: list[str] = []
    lengths: list[int] = []
    overlong: list[str] = []
    refused: list[tuple[str, str]] = []
    for r, row in enumerate(rows):
        overlong.extend(row.overlong)
        refused.extend((str(key), str(message)) for key, message in row.refused)
        offsets = [0]
        for s, (ids, mask) in enumerate(zip(row.token_ids, row.loss_masks, strict=True)):
            start, n = offsets[-1], len(ids)
            ids_np[r, start : start + n] = ids
            mask_np[r, start : start + n] = mask
            positions_np[r, start : start + n] = np.arange(n)
            segments_np[r, start : start + n] = s
            offsets.append(start + n)
            lengths.append(n)
        cu_seqlens.append(offsets)
        source_ids.extend(row.source_ids)
    input_ids, loss_mask = torch.from_numpy(ids_np), torch.from_numpy(mask_np)
    position_ids, segment_ids = torch.from_numpy(positions_np), torch.from_numpy(segments_np)
    return SFTBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        position_ids=position_ids,
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
        source_ids=source_ids,
        sequence_lengths=lengths,
        overlong_ids=overlong,
        refused_samples=refused,
    )


class SFTTaskEncoder(TaskEncoder[ChatSample, EncodedChat, EncodedChat, SFTBatch]):
    """Tokenize, mask, truncate, optionally pack, and pad into an `SFTBatch`."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        max_input_seq_length: int,
        pad_multiple: int = 1,
        only_unmask_final: bool = False,
        packing_algorithm: str | None = None,
        max_sequences_per_bin: int | None = None,
        balanced_knapsack_delta: int = 0,
        overlong: str = "truncate",
        chat_format: ChatFormat | None = None,
        prompt: str | None = None,
    ) -> None:
        super().__init__()
        self.overlong = overlong
        self.chat_format = chat_format
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.max_input_seq_length = max_input_seq_length
        self.pad_multiple = pad_multiple
        self.only_unmask_final = only_unmask_final
        self.packing_algorithm = packing_algorithm
        self.max_sequences_per_bin = max_sequences_per_bin
        self.balanced_knapsack_delta = balanced_knapsack_delta

    @stateless
    def encode_sample(self, sample: ChatSample) -> EncodedChat:
        try:
            ids, mask, too_long = encode_sample_tokens(
                self.tokenizer,
                sample.messages,
                max_length=self.max_input_seq_length,
                only_unmask_final=self.only_unmask_final,
                overlong=self.overlong,
                chat_format=self.chat_format,
                prompt=self.prompt,
                tools=sample.tools,
            )
        except Exception as exc:  # noqa: BLE001 - a template's refusal can be any type
            # One zero-weight pad token holds the sample's place; the error rides along.
            refusal = [sample.__key__, f"{type(exc).__name__}: {exc}"]
            return EncodedChat.derive_from(
                sample,
                source_ids=[sample.__key__],
                token_ids=[[self.tokenizer.pad_id]],
                loss_masks=[[0.0]],
                refused=[refusal],
            )
        if not any(mask) and (not too_long or self.overlong == "truncate"):
            # Nothing to learn (truncation cut every supervised token): skipped as before.
            raise SkipSample()
        return EncodedChat.derive_from(
            sample,
            source_ids=[sample.__key__],
            token_ids=[ids],
            loss_masks=[mask],
            overlong=[sample.__key__] if too_long else [],
            refused=[],
        )

    @stateless
    def batch(self, samples: list[EncodedChat]) -> SFTBatch:
        rows = samples if self.packing_algorithm is None else self.pack(samples)
        return collate_rows(rows, pad_id=self.tokenizer.pad_id, pad_multiple=self.pad_multiple)

    def pack(self, samples: list[EncodedChat]) -> list[EncodedChat]:
        """One step's conversations (this rank's share of the global batch) packed into rows
        of at most ``max_input_seq_length`` tokens, each conversation its own segment."""
        assert self.packing_algorithm is not None
        bins = plan_bins(
            [s.length for s in samples],
            self.max_input_seq_length,
            self.packing_algorithm,
            max_per_bin=self.max_sequences_per_bin,
            rng=_shuffle_rng(samples),
            balanced_knapsack_delta=self.balanced_knapsack_delta,
        )
        return [join_rows([samples[i] for i in b]) for b in bins]


def _shuffle_rng(samples: list[EncodedChat]) -> random.Random:
    """``first_fit_shuffle``'s randomness: seeded by the step's own source ids, so a resumed
    or re-read step plans the same rows and no global RNG is touched."""
    keys = "\n".join(sid for s in samples for sid in s.source_ids)
    return random.Random(hashlib.sha256(keys.encode()).digest())


def join_rows(samples: list[EncodedChat]) -> EncodedChat:
    """The chosen samples concatenated into one row, each kept as its own segment."""
    return EncodedChat(
        __key__="+".join(s.__key__ for s in samples),
        __restore_key__=(),
        __subflavors__=None,
        __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
        source_ids=[sid for s in samples for sid in s.source_ids],
        token_ids=[ids for s in samples for ids in s.token_ids],
        loss_masks=[m for s in samples for m in s.loss_masks],
        overlong=[sid for s in samples for sid in s.overlong],
        refused=[r for s in samples for r in s.refused],
    )

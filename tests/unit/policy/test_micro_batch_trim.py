"""A micro-batch runs over its own rows' width, not the rank's longest sample's.

A rank's rows are collated once, padded to the longest of them; slicing micro-batches out of
that keeps the padding. The replica cuts the columns that are padding in every row of a
micro-batch before the forward pass: the loss is the same up to rounding, the gradients too,
and the same batch gives the same step every time (exact resume needs nothing more).
"""

from __future__ import annotations

import pytest
import torch

from sft_runtime.runtime.data.task_encoder import EncodedChat, collate_rows
from sft_runtime.runtime.policy import replica as replica_module
from sft_runtime.runtime.policy.config import ModelConfig, PolicyConfig
from sft_runtime.runtime.policy.loss import NLLLossFn
from sft_runtime.runtime.policy.model import forward_logits
from sft_runtime.runtime.policy.replica import Replica
from tests.support.encoded_rows import random_rows

VOCAB, LONGEST = 64, 48


def _rows(lengths: list[int], seed: int = 0) -> list[EncodedChat]:
    return random_rows(lengths, VOCAB, seed)


def test_trimmed_drops_only_columns_that_are_padding_in_every_row():
    batch = collate_rows(_rows([5, 11, 40, 9]), pad_id=0, pad_multiple=8)
    assert batch.input_ids.shape[1] == 40
    short = batch.rows(0, 2).trimmed(8)
    assert short.input_ids.shape[1] == 16  # 11 tokens, rounded up to a multiple of 8
    assert short.input_ids.shape[1] == short.segment_ids.shape[1] == short.loss_mask.shape[1]
    assert torch.equal(short.input_ids, batch.input_ids[:2, :16])
    assert torch.equal(short.loss_mask, batch.loss_mask[:2, :16])
    assert (batch.segment_ids[:2, 16:] == -1).all()
    assert batch.rows(0, 2).trimmed(1).input_ids.shape[1] == 11
    whole = batch.rows(2, 4)
    assert whole.trimmed(8) is whole  # nothing to cut: the same object


def _policy(micro: int) -> PolicyConfig:
    return PolicyConfig(
        precision="float32",
        dtensor_cfg={"enabled": False},
        model=ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=64),
        train_global_batch_size=4,
        train_micro_batch_size=micro,
        make_sequence_length_divisible_by=8,
    )


def test_a_trimmed_step_has_the_untrimmed_loss_and_repeats_bit_for_bit(monkeypatch):
    batch = collate_rows(_rows([6, 9, LONGEST, 12]), pad_id=0, pad_multiple=8)
    widths: list[int] = []

    def recording(model, mb):
        widths.append(int(mb.input_ids.shape[1]))
        return forward_logits(model, mb)

    monkeypatch.setattr(replica_module, "forward_logits", recording)

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        replica = Replica(_policy(micro=2), seed=0, device=torch.device("cpu"))
        replica.begin(None, lambda: batch)
        replica.train(batch)
        out = replica.finish()
        return out.loss, replica.files.weights()

    loss, weights = step()
    assert widths == [16, LONGEST]  # rows 0-1 run 16 columns wide, rows 2-3 the full 48

    # the loss of the same weights on the untrimmed rows, micro-batch by micro-batch
    reference = Replica(_policy(micro=2), seed=0, device=torch.device("cpu"))
    total = NLLLossFn().valid_tokens(batch)
    with torch.no_grad():
        untrimmed = sum(
            NLLLossFn()(
                forward_logits(reference.model, batch.rows(i, i + 2)), batch.rows(i, i + 2), total
            )[0].item()
            for i in (0, 2)
        )
    assert loss == pytest.approx(untrimmed, rel=1e-5)

    again, weights_again = step()
    assert again == loss
    assert all(torch.equal(weights[name], weights_again[name]) for name in weights)


# ----------------------------------------------------------------------------- packed rows
def _packed(layout: list[list[int]], seed: int = 0):
    """Packed rows of the given sample lengths, collated as the loader collates them."""
    from sft_runtime.runtime.data.task_encoder import join_rows

    samples = iter(_rows([n for row in layout for n in row], seed))
    rows = [join_rows([next(samples) for _ in row]) for row in layout]
    return collate_rows(rows, pad_id=0, pad_multiple=8)


LAYOUT = [[9, 5, 12], [14, 3], [7, 20], [6, 6]]  # rows of 26, 17, 27, 12 tokens


def test_joined_lays_the_rows_real_tokens_end_to_end_as_one_row():
    batch = _packed(LAYOUT)
    assert batch.input_ids.shape == (4, 32)
    joined = batch.joined(8)
    ends = [26, 17, 27, 12]
    assert joined.input_ids.shape == (1, 88)  # 82 tokens rounded up to a multiple of 8
    for name in ("input_ids", "loss_mask", "position_ids"):
        got, rows = getattr(joined, name)[0], getattr(batch, name)
        assert torch.equal(got[:82], torch.cat([rows[r, :e] for r, e in enumerate(ends)]))
        assert not got[82:].any()  # the padding holds nothing
    # every sample keeps a segment of its own, across rows too; the tail is padding
    segments = joined.segment_ids[0]
    assert segments[:82].unique().tolist() == list(range(9))
    assert (segments[82:] == -1).all()
    assert joined.cu_seqlens == [[0, 9, 14, 26, 40, 43, 50, 70, 76, 82]]
    assert all(joined.loss_mask[0, start] == 0 for start in joined.cu_seqlens[0][:-1])
    assert batch.joined(1, round_to=32).input_ids.shape == (1, 96)


def _hf_policy(folder) -> PolicyConfig:
    return PolicyConfig(
        precision="float32",
        dtensor_cfg={"enabled": False},
        model_name=str(folder),
        train_global_batch_size=4,
        train_micro_batch_size=2,
        make_sequence_length_divisible_by=8,
    )


def test_packed_rows_of_an_hf_model_run_joined_with_the_rows_loss(monkeypatch, tmp_path):
    """No forward position is a row's padding, the loss is the padded rows' up to rounding,
    and the same batch gives the same step bit for bit."""
    from tests.support.hf_models import build_model

    build_model(tmp_path, family="llama", vocab_size=VOCAB, max_positions=128)
    batch = _packed(LAYOUT)
    widths: list[tuple[int, int]] = []

    def recording(model, mb):
        widths.append(tuple(mb.input_ids.shape))
        return forward_logits(model, mb)

    monkeypatch.setattr(replica_module, "forward_logits", recording)

    def step():
        replica = Replica(_hf_policy(tmp_path), seed=0, device=torch.device("cpu"))
        replica.begin(None, lambda: batch)
        rows = [m["rows"] for m in replica.train(batch)["micro_batches"]]
        return replica.finish(), rows, replica.files.weights()

    out, rows, weights = step()
    assert widths == [(1, 48), (1, 40)]  # 26 + 17 and 27 + 12 tokens, rounded up to 8
    assert rows == [2.0, 2.0]

    reference = Replica(_hf_policy(tmp_path), seed=0, device=torch.device("cpu"))
    total = NLLLossFn().valid_tokens(batch)
    with torch.no_grad():
        padded = sum(
            NLLLossFn()(forward_logits(reference.model, mb), mb, total)[0].item()
            for mb in (batch.rows(0, 2), batch.rows(2, 4))
        )
    assert out.loss == pytest.approx(padded, rel=1e-5)

    again, _, weights_again = step()
    assert again.loss == out.loss and again.grad_norm == out.grad_norm
    assert all(torch.equal(weights[name], weights_again[name]) for name in weights)

"""Tokenizer, chat template, loss mask, truncation and padding of the task encoder."""

from __future__ import annotations

import pytest
import torch

from sft_runtime.runtime.data.task_encoder import EncodedChat, collate_rows, encode_conversation
from sft_runtime.runtime.data.tokenizer import (
    ByteTokenizer,
    TokenizerSpec,
    apply_chat_template,
    build_tokenizer,
)

TOK = ByteTokenizer()
CONVO = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "ok!"},
]


def _supervised_text(ids: list[int], mask: list[float]) -> str:
    return TOK.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_byte_tokenizer_vocab_and_identity():
    tok = build_tokenizer(TokenizerSpec())
    assert isinstance(tok, ByteTokenizer)
    specials = {tok.pad_id, tok.bos_id, tok.eos_id, *(tok.role_id(r) for r in tok.ROLES)}
    assert len(specials) == 6 and min(specials) == 256 and max(specials) == tok.vocab_size - 1
    assert tok.identity() == ByteTokenizer().identity()
    assert tok.encode_text("é") == [0xC3, 0xA9]


def test_tokenizer_spec_rejects_bad_combinations():
    with pytest.raises(ValueError, match="policy.tokenizer.name"):
        TokenizerSpec(name="huggingface")  # the former spelling, refused naming NeMo RL's
    with pytest.raises(ValueError, match="policy.tokenizer.name"):
        TokenizerSpec.model_validate({"name": "byte", "path": "/tokenizers/x"})
    with pytest.raises(ValueError, match="extra"):
        TokenizerSpec(name="byte", vocab=3)


def test_template_layout():
    ids, supervised = apply_chat_template(TOK, CONVO)
    assert TOK.decode(ids) == (
        "<bos><system>S<eos><user>hi<eos><assistant>yo<eos><user>again<eos><assistant>ok!<eos>"
    )
    assert len(ids) == len(supervised)


def test_loss_mask_covers_every_assistant_reply_and_its_eos():
    ids, mask = encode_conversation(TOK, CONVO, max_length=1000)
    assert _supervised_text(ids, mask) == "yo<eos>ok!<eos>"
    assert mask[0] == 0.0


def test_only_unmask_final_keeps_just_the_last_reply():
    ids, mask = encode_conversation(TOK, CONVO, max_length=1000, only_unmask_final=True)
    assert _supervised_text(ids, mask) == "ok!<eos>"


def test_truncation_cuts_tokens_and_mask_together():
    full_ids, full_mask = encode_conversation(TOK, CONVO, max_length=1000)
    ids, mask = encode_conversation(TOK, CONVO, max_length=10)
    assert ids == full_ids[:10] and mask == full_mask[:10]
    assert _supervised_text(ids, mask) == "y"


def _row(key: str, *segments: list[int]) -> EncodedChat:
    return EncodedChat(
        __key__=key,
        __restore_key__=(),
        source_ids=[f"{key}{i}" for i in range(len(segments))],
        token_ids=list(segments),
        loss_masks=[[0.0] + [1.0] * (len(s) - 1) for s in segments],
    )


@pytest.mark.parametrize("multiple", [1, 8, 16])
def test_collate_pads_to_multiple_and_marks_boundaries(multiple):
    rows = [_row("a", [1, 2, 3], [4, 5]), _row("b", [6, 7, 8, 9, 10, 11, 12])]
    batch = collate_rows(rows, pad_id=TOK.pad_id, pad_multiple=multiple)
    width = batch.input_ids.shape[1]
    assert width % multiple == 0 and 7 <= width < 7 + multiple
    assert batch.cu_seqlens == [[0, 3, 5], [0, 7]]
    assert batch.source_ids == ["a0", "a1", "b0"] and batch.sequence_lengths == [3, 2, 7]
    assert batch.input_ids[0, :5].tolist() == [1, 2, 3, 4, 5]
    assert (batch.input_ids[0, 5:] == TOK.pad_id).all()
    assert batch.segment_ids[0, :6].tolist() == [0, 0, 0, 1, 1, -1][: min(6, width)]
    assert batch.position_ids[0, :5].tolist() == [0, 1, 2, 0, 1]
    assert batch.loss_mask[0, :5].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert batch.valid_tokens == 3 + 6
    assert batch.loss_mask.dtype == torch.float32
    assert batch.packed and batch.rows(0, 1).packed and not batch.rows(1, 2).packed


def test_encoder_keeps_the_key_and_skips_samples_truncated_to_no_target():
    from megatron.energon import SkipSample

    from sft_runtime.runtime.data.sample import ChatSample
    from sft_runtime.runtime.data.task_encoder import SFTTaskEncoder

    encoder = SFTTaskEncoder(TOK, max_input_seq_length=10)
    sample = ChatSample(__key__="line000000007", __restore_key__=(), messages=CONVO)
    encoded = encoder.encode_sample(sample)
    assert encoded.source_ids == ["line000000007"] and encoded.length == 10
    short = SFTTaskEncoder(TOK, max_input_seq_length=9)
    with pytest.raises(SkipSample):
        short.encode_sample(sample)

"""What happens to a sample over the length limit, and to one the chat template refuses.

The encoder decides, per sample, from the sample alone; the counts travel in the batch (also
across energon's worker processes) to the loader's envelope, where the step reads them.
"""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
from megatron.energon import SkipSample

from sft_runtime.runtime.data.sample import ChatSample
from sft_runtime.runtime.data.task_encoder import SFTTaskEncoder, encode_conversation, join_rows
from sft_runtime.runtime.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
CHAT = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "general kenobi"},
]
FULL = len(TOK.encode_chat(CHAT)[0])  # 33 byte tokens


def _sample(key: str = "line000000001", messages=CHAT) -> ChatSample:
    return ChatSample(__key__=key, __restore_key__=(), messages=messages)


def _encode(limit: int, overlong: str, sample: ChatSample | None = None):
    encoder = SFTTaskEncoder(TOK, max_input_seq_length=limit, overlong=overlong)
    return encoder.encode_sample(sample or _sample())


@pytest.mark.parametrize("overlong", ["mask", "truncate", "drop"])
def test_a_sample_within_the_limit_is_the_same_under_every_policy(overlong):
    encoded = _encode(FULL, overlong)
    ids, mask = encode_conversation(TOK, CHAT, max_length=FULL)
    assert encoded.token_ids == [ids] and encoded.loss_masks == [mask]
    assert list(encoded.overlong) == [] and list(encoded.refused) == []


def test_mask_cuts_to_the_limit_and_weights_the_sample_zero():
    encoded = _encode(FULL - 3, "mask")
    ids, _ = encode_conversation(TOK, CHAT, max_length=FULL)
    assert encoded.token_ids == [ids[: FULL - 3]]
    assert encoded.loss_masks == [[0.0] * (FULL - 3)]
    assert list(encoded.overlong) == ["line000000001"]


def test_truncate_trains_on_what_remains_and_counts_it():
    encoded = _encode(FULL - 3, "truncate")
    ids, mask = encode_conversation(TOK, CHAT, max_length=FULL - 3)
    assert encoded.token_ids == [ids] and encoded.loss_masks == [mask] and sum(mask) > 0
    assert list(encoded.overlong) == ["line000000001"]


def test_truncate_still_skips_a_sample_with_nothing_left_to_learn():
    with pytest.raises(SkipSample):
        _encode(5, "truncate")  # the cut falls inside the user's turn


def test_drop_leaves_one_zero_weight_token_in_the_sample_place():
    encoded = _encode(FULL - 3, "drop")
    assert encoded.token_ids == [[TOK.bos_id]] and encoded.loss_masks == [[0.0]]
    assert list(encoded.overlong) == ["line000000001"]


def test_a_refused_sample_travels_as_a_record_of_the_error():
    bad = _sample("line000000007", [{"role": "narrator", "content": "once upon a time"}])
    encoded = _encode(FULL, "mask", bad)
    assert encoded.token_ids == [[TOK.pad_id]] and encoded.loss_masks == [[0.0]]
    ((key, message),) = encoded.refused
    assert key == "line000000007" and "narrator" in message


def test_the_counts_survive_packing_collation_and_the_trip_between_processes():
    encoder = SFTTaskEncoder(TOK, max_input_seq_length=FULL - 3, overlong="mask")
    bad = _sample("line000000007", [{"role": "narrator", "content": "x"}])
    rows = [encoder.encode_sample(_sample(f"line00000000{i}")) for i in (1, 2)]
    packed = join_rows([*rows, encoder.encode_sample(bad)])  # one packed row
    batch = encoder.batch([packed])
    assert batch.overlong_ids == ["line000000001", "line000000002"]
    assert [key for key, _ in batch.refused_samples] == ["line000000007"]
    assert batch.valid_tokens == 0
    crossed = pickle.loads(bytes(ForkingPickler.dumps(batch)))  # energon's worker queues
    assert crossed.overlong_ids == batch.overlong_ids
    assert crossed.refused_samples == batch.refused_samples
    micro = batch.rows(0, 1)
    assert micro.overlong_ids == batch.overlong_ids

"""A pretrained Hugging Face model as the policy: dtype, packing, names, folders, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from sft_runtime.runtime.checkpoint import policy_files
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy.hf_model import (
    hf_logits,
    hf_state_dict,
    load_hf_model,
    load_hf_state_dict,
    write_hf_config,
)
from sft_runtime.runtime.policy.model_path import hf_config
from tests.support.hf_models import build_model

FAMILIES = ("llama", "qwen2")


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    build_model(out, family=request.param, vocab_size=97, max_positions=64)
    return out


def _packed_row(lengths: list[int], vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    ids = torch.cat(samples).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    segments = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)]).unsqueeze(0)
    return samples, ids, positions, segments


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_packed_sample_gives_the_logits_of_the_sample_alone(folder, attention):
    model = load_hf_model(str(folder), attn_implementation=attention).eval()
    samples, ids, positions, segments = _packed_row([9, 5, 12], vocab=97)
    with torch.no_grad():
        packed = hf_logits(model, ids, positions, segments)[0]
        start = 0
        for sample in samples:
            n = len(sample)
            alone = model(input_ids=sample.unsqueeze(0)).logits[0]
            torch.testing.assert_close(packed[start : start + n], alone, rtol=1e-5, atol=1e-5)
            start += n
        # without the mask the second sample would see the first: the test can fail
        leaky = model(input_ids=ids, position_ids=positions).logits[0]
        assert not torch.allclose(leaky[9:14], packed[9:14], atol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_rows_of_one_sample_take_the_padding_mask_and_give_the_same_logits(folder, attention):
    model = load_hf_model(str(folder), attn_implementation=attention).eval()
    lengths, width = [11, 6], 16
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    positions = torch.zeros_like(ids)
    segments = torch.full_like(ids, -1)
    for r, sample in enumerate(samples):  # right-padded, as the loader collates
        n = len(sample)
        ids[r, :n], positions[r, :n], segments[r, :n] = sample, torch.arange(n), 0
    with torch.no_grad():
        plain = hf_logits(model, ids, positions, segments, packed=False)
        masked = hf_logits(model, ids, positions, segments)
        for r, sample in enumerate(samples):
            n = len(sample)
            alone = model(input_ids=sample.unsqueeze(0)).logits[0]
            torch.testing.assert_close(plain[r, :n], alone, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(plain[r, :n], masked[r, :n], rtol=1e-5, atol=1e-5)


def test_a_bf16_folder_loads_as_float32_master_weights(tmp_path):
    build_model(tmp_path, family="llama", vocab_size=97, dtype=torch.bfloat16)
    stored = policy_files.load_weights(str(tmp_path))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    model = load_hf_model(str(tmp_path))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = model.state_dict()
    for name, tensor in stored.items():  # the same numbers, only wider
        assert torch.equal(state[name], tensor.float())


def test_names_are_the_models_own_and_round_trip(folder, tmp_path):
    model = load_hf_model(str(folder))
    state = hf_state_dict(model)
    assert not any(name.startswith("inner.") for name in state)
    assert set(state) <= set(model.state_dict())
    policy_files.save_weights(str(tmp_path), {k: v.clone() for k, v in state.items()})
    write_hf_config(model, tmp_path, dtype=torch.float32)
    fresh = load_hf_model(str(tmp_path))  # the saved folder is a model folder
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    load_hf_state_dict(fresh, policy_files.load_weights(str(tmp_path)))
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_weights_past_the_shard_limit_are_sharded_with_an_index(folder, tmp_path):
    model = load_hf_model(str(folder))
    state = {k: v.clone() for k, v in hf_state_dict(model).items()}
    written = policy_files.save_weights(str(tmp_path), state, max_shard_bytes=40_000)
    index = json.loads((tmp_path / policy_files.WEIGHTS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and set(index["weight_map"]) == set(state)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert len(written) == len(shards) + 1
    loaded = policy_files.load_weights(str(tmp_path))
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    write_hf_config(model, tmp_path, dtype=torch.float32)
    fresh = load_hf_model(str(tmp_path))  # transformers reads the sharded folder too
    assert all(torch.equal(fresh.state_dict()[k], state[k]) for k in state)


def test_a_folder_whose_weights_do_not_cover_the_model_is_refused(folder, tmp_path):
    state = policy_files.load_weights(str(folder))
    dropped = sorted(state)[0]
    del state[dropped]
    policy_files.save_weights(str(tmp_path), state)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(UserInputError, match="freshly initialised") as err:
        load_hf_model(str(tmp_path))
    assert dropped in str(err.value)


def test_missing_folders_and_configs_are_named(tmp_path):
    with pytest.raises(UserInputError, match="no such model folder"):
        hf_config(str(tmp_path / "nowhere"))
    with pytest.raises(UserInputError, match="no config.json"):
        hf_config(str(tmp_path))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_bf16_stored_model_trains_in_the_configured_precision(tmp_path, precision):
    """Stored in bf16 (as hub models ship), trained with fp32 master weights, with or
    without bf16 autocast: the step runs, the weights move and stay float32."""
    from sft_runtime.runtime.policy.config import PolicyConfig
    from sft_runtime.runtime.policy.replica import Replica
    from tests.support import sources

    build_model(tmp_path, family="qwen2", vocab_size=97, dtype=torch.bfloat16)
    policy = PolicyConfig(
        dtensor_cfg={"enabled": False},
        model_name=str(tmp_path),
        train_global_batch_size=4,
        train_micro_batch_size=2,
        precision=precision,
    )
    replica = Replica(policy, seed=0, device=torch.device("cpu"))
    batch = sources.make_batch(0, 0, 0, rows=4, seq_len=16, vocab_size=97)
    before = replica.files.weights()
    replica.begin(None, lambda: batch)
    replica.train(batch)
    out = replica.finish()
    after = replica.files.weights()
    assert out.step == 1 and out.loss > 0 and out.grad_norm > 0
    assert {t.dtype for t in after.values()} == {torch.float32}
    assert any(not torch.equal(before[k], after[k]) for k in before)

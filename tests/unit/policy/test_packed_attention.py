"""Packed rows without a T x T mask: each sample's logits and gradients are the sample's
alone, for GQA and sliding-window models, and nothing of size T x T is ever allocated."""

from __future__ import annotations

import pytest
import torch

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy import rendezvous
from sft_runtime.runtime.policy.fsdp import enable_activation_checkpointing
from sft_runtime.runtime.policy.hf_model import hf_logits, load_hf_model
from sft_runtime.runtime.policy.packed_attention import (
    PACKED_ATTENTION,
    check_packed_attention,
    packed_forward,
    packed_sdpa,
    segment_bounds,
)
from tests.support.hf_models import build_model, tiny_model
from tests.support.memory import LargestTensor

VOCAB = 97
WINDOW = 6  # the sliding-window model's window: shorter than most samples below


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral-sliding"])
def folder(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral-sliding":
        _mistral(out)
    else:
        build_model(out, family=request.param, vocab_size=VOCAB, max_positions=64)
    return out


def _mistral(out) -> None:
    """Mistral with GQA and a sliding window shorter than the samples (its mask is banded)."""
    from transformers import MistralConfig, MistralForCausalLM

    model = tiny_model(
        MistralConfig,
        MistralForCausalLM,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        sliding_window=WINDOW,
    )
    model.save_pretrained(str(out))


def _rows(layout: list[list[int]], width: int, seed: int = 0):
    """Right-padded packed rows; ``layout`` holds each row's sample lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(layout), width, dtype=torch.long)
    positions = torch.zeros_like(ids)
    segments = torch.full_like(ids, -1)
    samples = []  # (row, start, tokens)
    for r, lengths in enumerate(layout):
        start = 0
        for s, n in enumerate(lengths):
            tokens = torch.randint(0, VOCAB, (n,), generator=g)
            ids[r, start : start + n] = tokens
            positions[r, start : start + n] = torch.arange(n)
            segments[r, start : start + n] = s
            samples.append((r, start, tokens))
            start += n
    return samples, ids, positions, segments


LAYOUT = [[9, 5, 12], [14, 3], [7]]  # three rows: packed, packed and padded, one sample
WIDTH = 28


def test_segments_never_cross_a_sample_or_a_row():
    _, _, _, segments = _rows(LAYOUT, WIDTH)
    bounds = segment_bounds(segments).bounds
    assert bounds == (
        (0, 9), (9, 14), (14, 26), (26, 28),  # row 0: three samples, then padding
        (28, 42), (42, 45), (45, 56),  # row 1
        (56, 63), (63, 84),  # row 2
    )  # fmt: skip
    # the same id in two rows is still two segments
    assert segment_bounds(torch.zeros(2, 4, dtype=torch.long)).bounds == ((0, 4), (4, 8))


def _transformers_sdpa(folder):
    """The same weights under transformers' own SDPA and masks: the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa"
    )


def test_each_packed_sample_gives_the_logits_and_gradients_of_the_sample_alone(folder):
    model = load_hf_model(str(folder))
    assert model.config._attn_implementation == PACKED_ATTENTION
    reference = _transformers_sdpa(folder)
    samples, ids, positions, segments = _rows(LAYOUT, WIDTH)
    weights = torch.randn(len(LAYOUT), WIDTH, VOCAB, generator=torch.Generator().manual_seed(3))
    weights[segments < 0] = 0.0  # padding counts for nothing, as in training

    packed = hf_logits(model, ids, positions, segments)
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    alone_total = 0.0
    for r, start, tokens in samples:
        n = len(tokens)
        alone = reference(input_ids=tokens.unsqueeze(0), use_cache=False).logits[0]
        torch.testing.assert_close(packed[r, start : start + n], alone, rtol=1e-5, atol=1e-5)
        alone_total = alone_total + (alone * weights[r, start : start + n]).sum()
    alone_total.backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-5, atol=1e-5)


def test_rows_of_one_sample_keep_the_models_own_attention(folder):
    """No segments: transformers' causal path, and a sliding window still applies (the
    packed name has no mask function, so the band comes from `packed_sdpa`)."""
    model = load_hf_model(str(folder)).eval()
    reference = _transformers_sdpa(folder).eval()
    samples, ids, positions, segments = _rows([[20], [13]], 20, seed=4)
    with torch.no_grad():
        ours = hf_logits(model, ids, positions, segments, packed=False)
        for r, _, tokens in samples:
            alone = reference(input_ids=tokens.unsqueeze(0), use_cache=False).logits[0]
            torch.testing.assert_close(ours[r, : len(tokens)], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_new_path_agrees_with_the_dense_mask_reference(family, tmp_path):
    """The eager model with the T x T mask is the reference; SDPA a sample at a time must match
    it, and without any separation the samples would differ (the check can fail). (The dense
    mask knows no sliding window, so a windowed model is held to the sample alone instead.)"""
    folder = tmp_path
    build_model(folder, family=family, vocab_size=VOCAB, max_positions=64)
    _, ids, positions, segments = _rows(LAYOUT, WIDTH, seed=1)
    fast = load_hf_model(str(folder)).eval()
    dense = load_hf_model(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        new = hf_logits(fast, ids, positions, segments)
        reference = hf_logits(dense, ids, positions, segments)
        leaky = fast(input_ids=ids, position_ids=positions, use_cache=False).logits
    real = segments >= 0
    torch.testing.assert_close(new[real], reference[real], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky[0, 9:14], new[0, 9:14], atol=1e-4)


def test_a_16k_token_packed_row_trains_a_step_without_a_t_by_t_tensor(tmp_path):
    t, samples = 16_384, 8
    build_model(tmp_path, family="llama", vocab_size=VOCAB, max_positions=t)
    model = load_hf_model(str(tmp_path))
    _, ids, positions, segments = _rows([[t // samples] * samples], t, seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with LargestTensor() as watch:
        logits = hf_logits(model, ids, positions, segments)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert all(
        not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True)
    )
    # the largest tensor is the logits (T x vocab) or a sample's own square, far below T x T
    print("largest tensor", watch.largest)
    assert watch.largest <= max(t * VOCAB, t * 128, 4 * (t // samples) ** 2) < t * t // 8


def test_attention_called_without_the_segments_in_a_packed_forward_is_an_error():
    q = torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    with packed_forward(), pytest.raises(RuntimeError, match="sequence_packing.enabled=false"):
        packed_sdpa(module, q, q, q, None)
    out, _ = packed_sdpa(module, q, q, q, None)  # outside a packed forward: plain SDPA
    assert out.shape == (1, 5, 2, 8)


def test_a_model_that_never_calls_the_interface_is_an_error():
    class Bypass(torch.nn.Module):
        """Looks loaded with the packed attention but never calls it."""

        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"_attn_implementation": PACKED_ATTENTION})()

        def forward(self, input_ids, **_):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 3)})()

    _, ids, positions, segments = _rows([[3, 4]], 7)
    with pytest.raises(RuntimeError, match="sequence_packing.enabled=false"):
        hf_logits(Bypass(), ids, positions, segments)


def test_a_model_class_outside_the_attention_interface_is_refused_for_packing():
    from transformers import BloomConfig, LlamaConfig

    with pytest.raises(UserInputError, match=r"BloomForCausalLM.*sequence_packing\.enabled"):
        check_packed_attention(BloomConfig(), "/models/bloom")
    check_packed_attention(LlamaConfig(), "/models/llama")  # takes it: no error


def test_activation_checkpointing_recomputes_with_the_segments(tmp_path):
    """The backward pass replays each layer's call, keywords and all: the same gradients."""
    build_model(tmp_path, family="llama", vocab_size=VOCAB, max_positions=64)
    _, ids, positions, segments = _rows(LAYOUT, WIDTH, seed=5)
    grads = []
    for checkpointing in (False, True):
        model = load_hf_model(str(tmp_path)).train()
        if checkpointing:
            enable_activation_checkpointing(
                model
            )  # what policy.dtensor_cfg.activation_checkpointing does
        hf_logits(model, ids, positions, segments)[segments >= 0].square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=1e-6, atol=1e-6)


def test_fsdp_casting_its_inputs_to_bf16_still_hands_the_segments_through(tmp_path):
    """FSDP2's mixed precision rebuilds containers in the forward's keywords to cast their
    tensors; the segments must reach attention (a copy would leave the caller's count at 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    build_model(tmp_path, family="llama", vocab_size=VOCAB, max_positions=64)
    _, ids, positions, segments = _rows(LAYOUT, WIDTH, seed=7)
    expected = hf_logits(load_hf_model(str(tmp_path)), ids, positions, segments).detach()
    store = rendezvous.serve()
    rendezvous.join("gloo", 0, 1, port=store.port, store=store)
    try:
        model = load_hf_model(str(tmp_path))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        got = hf_logits(model, ids, positions, segments)
        got[segments >= 0].float().square().mean().backward()
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got.float(), expected, rtol=0.0, atol=0.1)  # bf16 rounding


def test_activation_checkpointing_takes_the_older_transformers_name():
    """Before transformers 5.24 a model offers it only as ``gradient_checkpointing_enable``;
    a module offering neither name is refused with the config key."""

    class OlderTransformersModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list = []

        def gradient_checkpointing_enable(self, kwargs=None) -> None:
            self.calls.append(kwargs)

    model = OlderTransformersModel()
    enable_activation_checkpointing(model)
    assert model.calls == [{"use_reentrant": False}]
    with pytest.raises(ValueError, match=r"activation_checkpointing: Linear offers none"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))

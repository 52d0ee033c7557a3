"""The trainable-parameter count printed at the start of a run is what the workers train:
counted on the meta device, it equals the count of a replica built for real."""

from __future__ import annotations

import pytest
import torch

from sft_runtime.runtime.policy.config import ModelConfig, PolicyConfig
from sft_runtime.runtime.policy.param_count import count_parameters
from sft_runtime.runtime.policy.replica import Replica


def _real(policy: PolicyConfig) -> tuple[int, int]:
    model = Replica(policy, seed=0, device=torch.device("cpu")).model
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def test_the_built_in_transformer_trains_every_parameter():
    policy = PolicyConfig(model=ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4))
    count = count_parameters(policy)
    assert (count.trainable, count.total) == _real(policy)
    assert count.trainable == count.total and not count.lora
    assert f"{count.trainable:,}" in count.describe() and "full fine-tune" in count.describe()


@pytest.mark.parametrize("lora", [False, True])
def test_a_hugging_face_model_with_and_without_adapters(tiny_llama, lora):
    pytest.importorskip("peft")
    policy = PolicyConfig(
        model_name=str(tiny_llama),
        dtensor_cfg={"lora_cfg": {"enabled": lora, "dim": 4}},
    )
    count = count_parameters(policy)
    assert (count.trainable, count.total) == _real(policy)
    assert count.lora == lora and (count.trainable < count.total) == lora
    if lora:
        assert "LoRA" in count.describe() and f"{count.total:,}" in count.describe()

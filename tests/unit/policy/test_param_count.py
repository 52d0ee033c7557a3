"""The trainable-parameter count printed at the start of a run is what the workers train:
counted on the meta device, it equals the count of a replica built for real."""

from __future__ import annotations

import subprocess
import sys

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


def test_the_count_of_the_built_in_transformer_leaves_torchs_compiler_unimported():
    # the driver counts before every launch: initializers on the meta device would import
    # torch._dynamo (about 1 s; a Hugging Face model's modules import it anyway); the
    # initializers work again after the count
    code = (
        "import sys, torch\n"
        "from sft_runtime.runtime.policy.config import ModelConfig, PolicyConfig\n"
        "from sft_runtime.runtime.policy.param_count import count_parameters\n"
        "tiny = PolicyConfig(model=ModelConfig(vocab_size=64, d_model=32, n_layers=2))\n"
        "print(count_parameters(tiny).total)\n"
        "print('torch._dynamo' in sys.modules)\n"
        "print(float(torch.nn.init.ones_(torch.zeros(2)).sum()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    total, dynamo, ones = done.stdout.split()
    assert (
        int(total)
        == _real(PolicyConfig(model=ModelConfig(vocab_size=64, d_model=32, n_layers=2)))[1]
    )
    assert dynamo == "False"
    assert ones == "2.0"

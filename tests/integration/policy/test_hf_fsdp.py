"""A Hugging Face model sharded with FSDP2 end to end: train, export the sharded checkpoint
into one model folder, load it with transformers, start a run of another world size from it.

The tiny Llama of `tests.support.hf_models` on the demo chats, as in test_hf_training.py,
with ``policy.parallel.fsdp=true`` over 2 CPU workers (gloo).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.checkpoint.sharded import consolidate, is_sharded
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.policy.group import PolicyWorkerGroup
from sft_runtime.runtime.policy.hf_model import hf_logits, load_hf_model, load_hf_state_dict
from tests.support.fixtures import HF_STEPS, hf_overrides
from tests.support.reliability import committed
from tests.support.small_run import small_config

SHARDED = ("policy.parallel.fsdp=true", "policy.parallel.activation_checkpointing=true")


@pytest.fixture(scope="module")
def sharded_run(ray_session, demo_data, tiny_llama, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("hf-fsdp") / "run"
    config = small_config(run_dir, demo_data, HF_STEPS, *hf_overrides(tiny_llama), *SHARDED)
    summary = run_training(config)
    assert summary["reason"] == "completed" and summary["total_steps"] == HF_STEPS
    return run_dir


def test_a_sharded_group_reads_only_its_half_of_the_pretrained_model(
    ray_session, demo_data, tiny_llama, tmp_path
):
    """The run's own path (a worker group from the run's config) starts from the meta-device
    skeleton: each rank reads about half of the model's elements and together exactly all."""
    config = small_config(tmp_path / "run", demo_data, 1, *hf_overrides(tiny_llama), *SHARDED)
    group = PolicyWorkerGroup(config.policy, config.cluster, seed=0, name="test-hf-start")
    try:
        storage = group.local_storage()
    finally:
        group.shutdown()
    whole = storage[0]["start_read_full"]
    assert whole == sum(p.numel() for p in load_hf_model(str(tiny_llama)).parameters())
    assert sum(s["start_read_local"] for s in storage) == whole
    assert all(s["start_read_local"] <= whole // 2 + whole // 10 for s in storage)


def _weights(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}" / "policy" / "weights"


def test_sharded_fine_tuning_agrees_with_the_unsharded_run(sharded_run, hf_reference):
    got = committed(sharded_run)
    assert sorted(got) == sorted(hf_reference.committed)
    for step, (loss, digests) in got.items():
        ref_loss, ref_digests = hf_reference.committed[step]
        assert digests == ref_digests  # the same samples
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0), step
    weights = _weights(sharded_run, HF_STEPS)
    assert is_sharded(weights) and (weights / "config.json").is_file()
    assert not (weights / "model.safetensors").exists()


def test_the_export_of_a_sharded_checkpoint_loads_in_transformers_bit_for_bit(
    sharded_run, tiny_llama, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    assert cli_main(["export", str(sharded_run), str(out)]) == 0
    whole = consolidate(_weights(sharded_run, HF_STEPS))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    state = loaded.state_dict()
    assert set(whole) <= set(state)
    assert all(torch.equal(state[k], v) for k, v in whole.items())
    runtime = load_hf_model(str(tiny_llama)).eval()
    load_hf_state_dict(runtime, whole)
    ids = torch.randint(0, loaded.config.vocab_size, (1, 24), generator=torch.Generator())
    with torch.no_grad():
        ours = hf_logits(runtime, ids, torch.arange(24).unsqueeze(0), torch.zeros_like(ids))
        theirs = loaded(input_ids=ids).logits
    assert torch.equal(ours, theirs)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    tokenizer, original = (
        AutoTokenizer.from_pretrained(out),
        AutoTokenizer.from_pretrained(tiny_llama),
    )
    assert tokenizer.apply_chat_template(chat) == original.apply_chat_template(chat)


def test_a_sharded_checkpoint_starts_a_run_of_another_world_size(
    sharded_run, ray_session, demo_data, tmp_path, capsys
):
    out = tmp_path / "export"
    assert cli_main(["export", str(sharded_run), str(out), "--step", "4"]) == 0
    # one worker, unsharded, from what two sharded workers trained
    config = small_config(
        tmp_path / "next", demo_data, 1, *hf_overrides(out), "cluster.workers_per_node=1"
    )
    summary = run_training(config)
    assert summary["total_steps"] == 1
    first = committed(tmp_path / "next")[1][0]
    assert first < committed(sharded_run)[1][0]  # it starts from the trained weights
    # resuming the sharded run itself unsharded is refused before Ray starts, naming the key
    raw = ["train", "--run-dir", str(sharded_run), str(_config_file(sharded_run, tmp_path))]
    assert cli_main(raw) == 2
    assert "policy.parallel.fsdp" in capsys.readouterr().err


def _config_file(run_dir: Path, tmp_path: Path) -> Path:
    """The run's own config with sharding switched off and more steps to go."""
    import yaml

    config = yaml.safe_load(
        (run_dir / "checkpoints" / f"step_{HF_STEPS}" / "config.yaml").read_text()
    )
    config["policy"]["parallel"]["fsdp"] = False
    config["policy"]["parallel"]["activation_checkpointing"] = False
    config["sft"]["max_num_steps"] = HF_STEPS + 2
    path = tmp_path / "unsharded.yaml"
    path.write_text(yaml.safe_dump(config))
    return path

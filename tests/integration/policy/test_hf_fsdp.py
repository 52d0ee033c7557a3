"""A Hugging Face model sharded with FSDP2 end to end: train, export the sharded checkpoint
into one model folder, load it with transformers, start a run of another world size from it.

The tiny Llama of `tests.support.hf_models` on the demo chats, as in test_hf_training.py,
with ``policy.dtensor_cfg.enabled=true`` over 2 CPU workers (gloo).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.checkpoint.policy_files import load_weights
from sft_runtime.runtime.checkpoint.sharded import is_sharded
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.policy.hf_model import hf_logits, load_hf_model, load_hf_state_dict
from sft_runtime.runtime.workers.group import PolicyWorkerGroup
from tests.support import worker_probes
from tests.support.fixtures import HF_STEPS, hf_overrides
from tests.support.reliability import committed
from tests.support.small_run import small_config

SHARDED = ("policy.dtensor_cfg.enabled=true", "policy.dtensor_cfg.activation_checkpointing=true")


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
        storage = worker_probes.local_storage(group)
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


def _runtime_logits(tiny_llama: Path, weights: dict, ids: torch.Tensor) -> torch.Tensor:
    runtime = load_hf_model(str(tiny_llama)).eval()
    load_hf_state_dict(runtime, weights)
    with torch.no_grad():
        n = ids.shape[1]
        return hf_logits(runtime, ids, torch.arange(n).unsqueeze(0), torch.zeros_like(ids))


def _probe(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))


def test_the_export_of_a_sharded_checkpoint_streams_into_shards_that_load_bit_for_bit(
    sharded_run, tiny_llama, tmp_path
):
    """Weight files of at most --max-shard-size (here 3+ of them) and their index, as
    save_pretrained writes them: transformers loads the trained weights and logits exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    assert cli_main(["export", str(sharded_run), str(out), "--max-shard-size", "100KB"]) == 0
    files = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(files) >= 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    for f in files:  # a file over the limit holds one tensor larger than it
        held = [k for k, v in index["weight_map"].items() if v == f.name]
        assert len(held) == 1 or f.stat().st_size <= 100_000 + 8_192, (f.name, held)
    whole = load_weights(_weights(sharded_run, HF_STEPS))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    state = loaded.state_dict()
    assert set(whole) <= set(state)
    assert all(torch.equal(state[k], v) for k, v in whole.items())
    ids = _probe(loaded.config.vocab_size)
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits
    assert torch.equal(_runtime_logits(tiny_llama, whole, ids), theirs)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    tokenizer, original = (
        AutoTokenizer.from_pretrained(out),
        AutoTokenizer.from_pretrained(tiny_llama),
    )
    assert tokenizer.apply_chat_template(chat) == original.apply_chat_template(chat)


def test_a_bfloat16_export_holds_the_trained_weights_rounded_once(
    sharded_run, tiny_llama, tmp_path
):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bf16"
    assert cli_main(["export", str(sharded_run), str(out), "--dtype", "bfloat16"]) == 0
    whole = load_weights(_weights(sharded_run, HF_STEPS))
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()  # config.json says bfloat16
    state = loaded.state_dict()
    assert all(state[k].dtype == torch.bfloat16 for k in whole)
    assert all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in whole.items())
    ids = _probe(loaded.config.vocab_size)
    with torch.no_grad():
        theirs = loaded.float()(input_ids=ids).logits
    ours = _runtime_logits(tiny_llama, whole, ids)
    assert not torch.equal(ours, theirs)  # rounded...
    assert torch.allclose(ours, theirs, rtol=0.05, atol=0.05)  # ...within bf16's rounding


def test_a_killed_export_leaves_no_folder_and_the_next_export_completes(sharded_run, tmp_path):
    """Killed (SIGKILL) after its second weights file: OUT does not exist, only a temporary
    folder does, which the next export removes before it writes OUT whole."""
    out = tmp_path / "export"
    env = {**os.environ, "SFT_RUNTIME_FAULT": "export:after_shard@2"}
    cmd = [sys.executable, "-m", "sft_runtime.runtime.cli.main", "export", str(sharded_run)]
    killed = subprocess.run([*cmd, str(out), "--max-shard-size", "100KB"], env=env, check=False)
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists()
    (left,) = tmp_path.glob(".export.tmp-*")
    assert len(list(left.glob("model-*.safetensors"))) == 2
    assert not (left / "model.safetensors.index.json").exists()
    assert cli_main(["export", str(sharded_run), str(out), "--max-shard-size", "100KB"]) == 0
    assert not left.exists() and (out / "model.safetensors.index.json").is_file()


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
    assert "policy.dtensor_cfg.enabled" in capsys.readouterr().err


def _config_file(run_dir: Path, tmp_path: Path) -> Path:
    """The run's own config with sharding switched off and more steps to go."""
    import yaml

    config = yaml.safe_load(
        (run_dir / "checkpoints" / f"step_{HF_STEPS}" / "config.yaml").read_text()
    )
    config["policy"]["dtensor_cfg"]["enabled"] = False
    config["policy"]["dtensor_cfg"]["activation_checkpointing"] = False
    config["sft"]["max_num_steps"] = HF_STEPS + 2
    path = tmp_path / "unsharded.yaml"
    path.write_text(yaml.safe_dump(config))
    return path

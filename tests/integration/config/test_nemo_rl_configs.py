"""NeMo RL's own base SFT config and its LoRA recipe train here as NeMo RL ships them.

The files under ``tests/support/nemo_rl`` are NeMo RL's ``examples/configs/sft.yaml`` and
``recipes/llm/sft-llama3.1-8b-1n8g-fsdp2tp1-lora.yaml``, key for key. The only overrides are
what a user on this machine must give: the model (a local folder, no hub), the data (a local
``openai_format`` file instead of a hub data set), ``cluster.gpus_per_node=0`` (no GPU) and a
step budget. Everything else is theirs: FSDP2 on, bfloat16, NeMo RL's chat template with BOS
and EOS added, validation at the start, a checkpoint ranked by ``val:val_loss``, the loggers
(wandb offline here, there being no network).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from sft_runtime.events import read_log
from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.data.demo import demo_conversation

NEMO_RL = Path(__file__).resolve().parents[2] / "support" / "nemo_rl"
BASE = NEMO_RL / "sft.yaml"
LORA_RECIPE = NEMO_RL / "recipes" / "llm" / "sft-llama3.1-8b-1n8g-fsdp2tp1-lora.yaml"


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> Path:
    """A tiny Llama whose positions cover NeMo RL's lengths (1024 in the base, 4096 in the
    recipe): Llama's rotary positions cost no parameters."""
    pytest.importorskip("transformers")
    from tests.support.hf_models import build_model, demo_texts, train_tokenizer

    out = tmp_path_factory.mktemp("hf") / "llama-4k"
    tok = train_tokenizer(out, demo_texts(), template="llama3")
    build_model(
        out,
        family="llama",
        vocab_size=len(tok),
        max_positions=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    return out


def _chats(path: Path, count: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"messages": demo_conversation(rng)}) + "\n")
    return path


def _train(config: Path, *overrides: str) -> int:
    return main(["train", "--config", str(config), *overrides])


def _steps(run_dir: Path) -> list[dict]:
    return [r.data for r in read_log(run_dir) if r.type == "step_committed"]


def test_nemo_rls_sft_yaml_trains_validates_and_resumes_exactly(
    ray_session, long_llama, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # NeMo RL's relative folders (logs, results/sft) land here
    monkeypatch.setenv("WANDB_MODE", "offline")
    train = _chats(tmp_path / "train.jsonl", 96, seed=0)
    val = _chats(tmp_path / "val.jsonl", 40, seed=1)
    given = (
        f"policy.model_name={long_llama}",
        "data.train.dataset_name=openai_format",
        f"+data.train.data_path={train}",
        "data.validation.dataset_name=openai_format",
        f"+data.validation.data_path={val}",
        "cluster.gpus_per_node=0",
    )
    assert _train(BASE, *given, "sft.max_num_steps=2") == 0, capsys.readouterr().err
    run_dir = tmp_path / "logs"
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["source_samples"] == 32 for s in steps)  # NeMo RL's global batch
    records = list(read_log(run_dir))
    started = next(r.data for r in records if r.type == "run_started")
    assert started["logical_world_size"] == 2  # gpus_per_node=0: CPU workers, two by default
    assert any(r.type == "validation_completed" and r.data["step"] == 0 for r in records)
    assert (tmp_path / "results" / "sft").is_dir()  # checkpointing.checkpoint_dir
    # NeMo RL's loggers: wandb (offline, no network here) and TensorBoard under the run
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert list((run_dir / "tb_logs-sft-dev-openai_format").glob("events.out.tfevents.*"))

    # the same command with one more step resumes from step 2; a fresh run of 3 steps is
    # the reference, and step 3 must be its equal bit for bit
    assert _train(BASE, *given, "sft.max_num_steps=3") == 0, capsys.readouterr().err
    resumed = _steps(run_dir)
    shutil.move(str(run_dir), str(tmp_path / "resumed"))
    shutil.move(str(tmp_path / "results"), str(tmp_path / "resumed-results"))
    assert _train(BASE, *given, "sft.max_num_steps=3") == 0, capsys.readouterr().err
    reference = _steps(run_dir)
    assert [s["step"] for s in resumed] == [1, 2, 3] and len(reference) == 3
    for ours, theirs in zip(resumed, reference, strict=True):
        assert ours["loss"] == theirs["loss"] and ours["grad_norm"] == theirs["grad_norm"]


def test_nemo_rls_lora_recipe_trains_as_given(
    ray_session, long_llama, tmp_path, monkeypatch, capsys
):
    """The recipe: its `defaults:` chain, automodel_cfg's LoRA over the base's dtensor_cfg,
    a held-out split of the training file (no validation file), add_generation_prompt."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    data = _chats(tmp_path / "tulu.jsonl", 3000, seed=2)
    given = (
        f"policy.model_name={long_llama}",
        f"policy.tokenizer.name={long_llama}",
        "data.train.dataset_name=openai_format",
        f"+data.train.data_path={data}",
        "cluster.gpus_per_node=0",
        "sft.max_num_steps=1",
    )
    assert _train(LORA_RECIPE, *given) == 0, capsys.readouterr().err
    run_dir = tmp_path / "logs" / "sft-tmblog-llama3.1-8b"
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == [1] and steps[0]["source_samples"] == 128
    records = list(read_log(run_dir))
    started = next(r.data for r in records if r.type == "run_started")
    assert started["logical_world_size"] == 2
    assert any(r.type == "validation_completed" for r in records)  # from the held-out 5%
    adapters = list((tmp_path / "results" / "sft-tmblog-llama3.1-8b").rglob("lora.json"))
    assert adapters, "a LoRA checkpoint holds lora.json"
    assert json.loads(adapters[0].read_text())["lora"]["dim"] == 128

"""A sharded start from hub-like folders: bf16 weights in several safetensors files under an
index, a tiny Llama and a tiny Qwen2 whose LM head is tied to its embedding.

With ``policy.dtensor_cfg.enabled=true`` each of the 2 workers builds the model on the meta device,
shards it and reads only its rows of each tensor (`runtime.policy.hf_shards`). That the rows
are today's whole load, slice for slice, is tests/unit/policy/test_hf_shards.py's; here the
runs themselves: 5 sharded steps agree with the unsharded run of the same folder (both load
the bf16 weights as float32) within 1e-5 relative on the same samples, and the tied model's
sharded run killed mid-run and resumed is its uninterrupted sharded run bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.checkpoint.sharded import is_sharded
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.policy.hf_shards import can_slice
from tests.support.fixtures import HF_STEPS, hf_overrides
from tests.support.reliability import (
    Reference,
    attempts_of,
    committed,
    compare,
    load_weights,
    weights_path,
)
from tests.support.small_run import small_config

SHARDED = ("policy.dtensor_cfg.enabled=true",)
INDEX = "model.safetensors.index.json"
EMBEDDING = "model.embed_tokens.weight"
MAX_SHARD = "40KB"  # smaller than the embedding alone (400-512 x 64 in bf16): 6+ files
KILL = "stepping:after_train@4"  # step 4 trained, never committed; checkpoints at 2, 4, 5


def _reshard(out: Path, model) -> None:
    """Replace the folder's weights by `model`'s in bf16, across files under an index."""
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    model.to(torch.bfloat16).save_pretrained(str(out), max_shard_size=MAX_SHARD)


def _llama(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.support.hf_models import hf_model_dir

    hf_model_dir(out, family="llama", dtype=torch.bfloat16)
    _reshard(out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16))


def _tied_qwen2(out: Path) -> None:
    """hf_model_dir's Qwen2 (ChatML tokenizer and ids) rebuilt with tied embeddings."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    from tests.support.hf_models import hf_model_dir

    hf_model_dir(out, family="qwen2", dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(out)
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _reshard(out, model)


@pytest.fixture(scope="module", params=["llama", "qwen2-tied"])
def folder(request, tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from safetensors import safe_open

    out = tmp_path_factory.mktemp("hf-sharded-start") / request.param
    (_llama if request.param == "llama" else _tied_qwen2)(out)
    index = json.loads((out / INDEX).read_text())["weight_map"]
    files = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(files) >= 2 and not (out / "model.safetensors").exists()
    assert sorted(set(index.values())) == [f.name for f in files]
    for f in files:  # stored as on the hub: bf16 only
        with safe_open(str(f), framework="pt") as handle:
            assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}, f
    tied = json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    assert tied == (request.param == "qwen2-tied")
    assert ("lm_head.weight" in index) != tied  # a tied head is saved once, as the embedding
    assert can_slice(str(out))  # the sharded runs below take the sliced start
    return out


def _run(run_dir: Path, demo_data: Path, folder: Path, *extra: str) -> dict:
    config = small_config(run_dir, demo_data, HF_STEPS, *hf_overrides(folder), *extra)
    summary = run_training(config)
    assert summary["reason"] == "completed" and summary["total_steps"] == HF_STEPS
    return committed(run_dir)


@pytest.fixture(scope="module")
def sharded(ray_session, demo_data, folder, tmp_path_factory) -> Reference:
    """The folder fine-tuned sharded on 2 workers, uninterrupted, in-process."""
    run_dir = tmp_path_factory.mktemp("sharded") / "run"
    steps = _run(run_dir, demo_data, folder, *SHARDED)
    assert sorted(steps) == list(range(1, HF_STEPS + 1))
    assert is_sharded(weights_path(run_dir, HF_STEPS))
    return Reference(run_dir, HF_STEPS, steps, load_weights(run_dir, HF_STEPS))


def test_a_sharded_start_trains_as_the_unsharded_load_does(
    folder, sharded, ray_session, demo_data, tmp_path
):
    unsharded = tmp_path / "unsharded"
    want = _run(unsharded, demo_data, folder)
    assert not is_sharded(weights_path(unsharded, HF_STEPS))
    assert sorted(sharded.committed) == sorted(want)
    losses = [want[s][0] for s in sorted(want)]
    assert losses[-1] < losses[0]  # it learned something
    for step, (loss, digests) in sharded.committed.items():
        ref_loss, ref_digests = want[step]
        assert digests == ref_digests, step  # the same samples on the same ranks
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0), step
    # the same tensors under the same names: both checkpoints hold a tied head once, as the
    # embedding
    whole = load_weights(unsharded, HF_STEPS)
    assert sorted(sharded.weights) == sorted(whole)


# The tied folder alone: its resume restores what the Llama's does (sharded weights, moments
# and loaders of an HF model) and a head that is the embedding besides.
@pytest.mark.parametrize("folder", ["qwen2-tied"], indirect=True)
def test_a_sharded_run_killed_mid_run_resumes_to_the_uninterrupted_run_bit_for_bit(
    folder, sharded, make_runner
):
    runner = make_runner("hf-sharded", steps=HF_STEPS, overrides=(*hf_overrides(folder), *SHARDED))
    crashed = runner.launch(fault=KILL)
    assert crashed.rc == 1, crashed.tail()  # the controller died: a run failure
    (first,) = attempts_of(runner.run_dir).values()
    steps = [r.data["step"] for r in first if r.type == "step_committed"]
    saved = [r.data["step"] for r in first if r.type == "checkpoint_saved"]
    assert steps == [1, 2, 3] and saved == [2], crashed.tail()  # killed inside step 4
    finished = runner.finish()
    assert [launch.rc for launch in finished] == [0], finished[-1].tail()
    attempts = attempts_of(runner.run_dir)
    assert len(attempts) == 2
    resumed = attempts[max(attempts)][0]
    assert resumed.type == "run_started" and resumed.data["resumed_from_step"] == 2
    result = compare(runner.run_dir, sharded)
    assert result.mismatches == [] and result.steps_compared == HF_STEPS
    assert result.reexecuted >= 1  # step 3 was rolled back with the kill and ran again

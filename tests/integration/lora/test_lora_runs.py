"""LoRA runs of the tiny Llama on the demo chats, held to a plain peft + transformers loop.

The runtime's LoRA run (`runtime.lora`: peft's layers injected into the transformers model,
packed rows) and a loop written the way a peft user writes one (`get_peft_model`, each
sample alone through transformers' own causal path, AdamW and clipping by hand) train on the
same samples, read again by the run's own loaders and checked against the digests in its
log, and must agree on every step's loss. Then: a kill mid-run resumes bit for bit, sharded
and not; a checkpoint holds the adapters only and names its base by digest; a resume on
another base is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sft_runtime.events import read_log
from sft_runtime.runtime.checkpoint.sharded import is_sharded
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.config import load_config
from sft_runtime.runtime.debug.samples import batch_samples
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.lora.adapters import init_adapters, is_adapter, peft_config
from sft_runtime.runtime.lora.base import BASE_FILE, weights_digest
from tests.support.fixtures import HF_STEPS, hf_overrides
from tests.support.reliability import (
    Reference,
    committed,
    compare,
    load_weights,
    weights_path,
)
from tests.support.small_run import small_config

LORA = (
    "policy.dtensor_cfg.lora_cfg.enabled=true",
    "policy.dtensor_cfg.lora_cfg.dim=4",
    "policy.dtensor_cfg.lora_cfg.alpha=8",
)
ONE_WORKER = ("cluster.workers_per_node=1",)
SHARDED = ("policy.dtensor_cfg.enabled=true",)
KILL = "stepping:after_train@4"  # step 4 trained, never committed; checkpoints at 2, 4, 5


def _overrides(folder: Path, *extra: str) -> tuple[str, ...]:
    return (*hf_overrides(folder), *LORA, *extra)


def _reference(run_dir: Path, demo_data: Path, folder: Path, *extra: str) -> Reference:
    config = small_config(run_dir, demo_data, HF_STEPS, *_overrides(folder, *extra))
    summary = run_training(config)
    assert summary["reason"] == "completed" and summary["total_steps"] == HF_STEPS
    return Reference(run_dir, HF_STEPS, committed(run_dir), load_weights(run_dir, HF_STEPS))


@pytest.fixture(scope="module")
def lora_dp1(ray_session, demo_data, tiny_llama, tmp_path_factory) -> Reference:
    run_dir = tmp_path_factory.mktemp("lora-dp1") / "run"
    return _reference(run_dir, demo_data, tiny_llama, *ONE_WORKER)


@pytest.fixture(scope="module")
def lora_fsdp(ray_session, demo_data, tiny_llama, tmp_path_factory) -> Reference:
    run_dir = tmp_path_factory.mktemp("lora-fsdp") / "run"
    return _reference(run_dir, demo_data, tiny_llama, *SHARDED)


def _run_samples(run_dir: Path, config) -> list[list]:
    """Every step's samples, all ranks', read by the run's own loaders from the start (as
    the run read them) and checked against the sample digests its log recorded."""
    from sft_runtime.runtime.config import loader_spec
    from sft_runtime.runtime.data.factory import build_colocated_loader
    from sft_runtime.runtime.data.tokenizer import build_tokenizer
    from sft_runtime.runtime.metrics.step_metrics import sample_digest

    (started, *_) = [r for r in read_log(run_dir) if r.type == "run_started"]
    logged = committed(run_dir)
    world = len(logged[1][1])
    spec = loader_spec(config, world)
    tokenizer = build_tokenizer(spec.tokenizer)
    steps: list[list] = [[] for _ in range(HF_STEPS)]
    for rank in range(world):
        loader = build_colocated_loader(spec, rank, world, started.data["placement_hash"])
        try:
            loader.setup(None)
            for step in range(1, HF_STEPS + 1):
                envelope = loader.load()
                assert sample_digest(envelope.source_ids) == logged[step][1][rank]
                steps[step - 1] += batch_samples(loader.active_batch, tokenizer)
                loader.commit()
        finally:
            loader.close()
    return steps


def _peft_loop_losses(run_dir: Path, folder: Path) -> list[float]:
    """The run's steps redone by a plain peft loop over the samples the run's log vouches
    for: every sample alone through the model, the NLL of its supervised tokens summed over
    the global batch and divided by their count, clipped, AdamW."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    config = load_config(weights_path(run_dir, HF_STEPS).parents[1] / "config.yaml")
    policy = config.policy
    targets = json.loads((weights_path(run_dir, HF_STEPS) / BASE_FILE).read_text())
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model = get_peft_model(
        base, peft_config(policy.dtensor_cfg.lora_cfg, targets["target_modules"])
    )
    init_adapters(
        model.base_model.model, policy.dtensor_cfg.lora_cfg, seed=config.sft.seed
    )  # the run's start
    params = [p for p in model.parameters() if p.requires_grad]
    assert policy.optimizer.name == "torch.optim.AdamW" and policy.scheduler is None
    optimizer = torch.optim.AdamW(params, **policy.optimizer.kwargs)
    model.train()
    losses = []
    for samples in _run_samples(run_dir, config):
        total = sum(sum(s.supervised[1:]) for s in samples)
        nll_sum = 0.0
        for sample in samples:
            ids = torch.tensor([sample.token_ids])
            mask = torch.tensor(sample.supervised[1:], dtype=torch.float32)
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            loss = (nll * mask).sum() / total
            loss.backward()
            nll_sum += float((nll * mask).sum().detach())
        torch.nn.utils.clip_grad_norm_(params, policy.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(nll_sum / total)
    return losses


def _losses(ref: Reference) -> list[float]:
    return [ref.committed[s][0] for s in sorted(ref.committed)]


def test_one_worker_lora_trains_as_a_plain_peft_loop_within_1e6(lora_dp1, tiny_llama):
    want = _peft_loop_losses(lora_dp1.run_dir, tiny_llama)
    got = _losses(lora_dp1)
    assert got[-1] < got[0]  # it learned
    assert got == pytest.approx(want, rel=1e-6, abs=0)


def test_two_sharded_workers_train_as_a_plain_peft_loop_within_1e5(lora_fsdp, tiny_llama):
    assert is_sharded(weights_path(lora_fsdp.run_dir, HF_STEPS))
    want = _peft_loop_losses(lora_fsdp.run_dir, tiny_llama)
    assert _losses(lora_fsdp) == pytest.approx(want, rel=1e-5, abs=0)


def test_a_lora_checkpoint_holds_the_adapters_only_and_names_its_base(lora_dp1, tiny_llama):
    weights = weights_path(lora_dp1.run_dir, HF_STEPS)
    assert lora_dp1.weights and all(is_adapter(name) for name in lora_dp1.weights)
    assert all(t.dtype == torch.float32 for t in lora_dp1.weights.values())
    record = json.loads((weights / BASE_FILE).read_text())
    assert record["base_model"] == str(tiny_llama)
    assert record["base_digest"] == weights_digest(tiny_llama)
    assert "lm_head" in record["target_modules"]  # every linear layer, the untied head too
    optimizer = torch.load(weights.parent / "optimizer" / "optimizer.pt", weights_only=True)
    moments = optimizer["optimizer"]["state"]
    adapter_count = len(lora_dp1.weights)
    assert len(moments) == adapter_count  # AdamW state for the adapters and nothing else


@pytest.mark.parametrize("extra", [ONE_WORKER, SHARDED], ids=["whole", "sharded"])
def test_a_lora_run_killed_mid_run_resumes_bit_for_bit(
    extra, lora_dp1, lora_fsdp, tiny_llama, make_runner
):
    ref = lora_dp1 if extra == ONE_WORKER else lora_fsdp
    runner = make_runner("lora", steps=HF_STEPS, overrides=_overrides(tiny_llama, *extra))
    crashed = runner.launch(fault=KILL)
    assert crashed.rc == 1, crashed.tail()
    finished = runner.finish()
    assert [launch.rc for launch in finished] == [0], finished[-1].tail()
    result = compare(runner.run_dir, ref)
    assert result.mismatches == [] and result.steps_compared == HF_STEPS
    assert result.reexecuted >= 1


def test_a_resume_on_another_base_is_refused_naming_both(lora_dp1, demo_data, tiny_llama, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(lora_dp1.run_dir, run_dir)
    other = tmp_path / "other-base"
    shutil.copytree(tiny_llama, other)
    from tests.support.hf_models import build_model

    tokenizer_vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    build_model(other, family="llama", vocab_size=tokenizer_vocab, seed=1)  # other weights
    config = small_config(run_dir, demo_data, HF_STEPS + 1, *_overrides(other, *ONE_WORKER))
    with pytest.raises(UserInputError) as info:
        run_training(config)
    message = str(info.value)
    assert str(other) in message and weights_digest(other) in message
    assert weights_digest(tiny_llama) in message and str(tiny_llama) in message


def _runtime_logits(run_dir: Path, folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """The runtime's forward pass with the run's final adapters: the model built as a worker
    builds it, the checkpoint's adapters loaded."""
    from sft_runtime.runtime.checkpoint.weight_reader import read_all
    from sft_runtime.runtime.lora.adapters import add_adapters
    from sft_runtime.runtime.policy.hf_model import hf_logits, load_hf_model

    config = load_config(weights_path(run_dir, HF_STEPS).parents[1] / "config.yaml")
    model = load_hf_model(str(folder))
    add_adapters(model, config.policy.dtensor_cfg.lora_cfg, seed=config.sft.seed)
    adapters = read_all(weights_path(run_dir, HF_STEPS))
    assert not any(
        torch.equal(model.state_dict()[k], v) for k, v in adapters.items() if "lora_B" in k
    )
    model.load_state_dict(adapters, strict=False)
    with torch.no_grad():
        n = ids.shape[1]
        return hf_logits(model.eval(), ids, torch.arange(n).unsqueeze(0), torch.zeros_like(ids))


def _ids(folder: Path) -> torch.Tensor:
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return torch.randint(3, vocab, (1, 24), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("run", ["lora_dp1", "lora_fsdp"])
def test_the_adapter_export_is_a_peft_folder_with_the_runtimes_logits_bit_for_bit(
    run, request, tiny_llama, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = request.getfixturevalue(run)
    out = tmp_path / "adapter"
    assert cli_main(["export", str(ref.run_dir), str(out)]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        tiny_llama
    )
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    ids = _ids(tiny_llama)
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    assert torch.equal(_runtime_logits(ref.run_dir, tiny_llama, ids), theirs)
    AutoTokenizer.from_pretrained(out)  # the tokenizer travels with the adapter


def test_the_merged_export_loads_without_peft_and_gives_the_runtimes_logits(
    lora_fsdp, tiny_llama, tmp_path
):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert cli_main(["export", str(lora_fsdp.run_dir), str(out), "--merge"]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not any("lora" in name for name in model.state_dict())
    ids = _ids(tiny_llama)
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    ours = _runtime_logits(lora_fsdp.run_dir, tiny_llama, ids)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, theirs, atol=1e-5)  # it moved


def test_merge_refuses_a_full_fine_tune_and_a_changed_base(
    lora_dp1, hf_reference, tiny_llama, tmp_path, capsys
):
    assert cli_main(["export", str(hf_reference.run_dir), str(tmp_path / "a"), "--merge"]) == 2
    assert "no adapters to merge" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    shutil.copytree(lora_dp1.run_dir, run_dir)
    record_file = weights_path(run_dir, HF_STEPS) / BASE_FILE
    record = json.loads(record_file.read_text())
    record["base_digest"] = "sha256:" + "0" * 64
    record_file.write_text(json.dumps(record))
    assert cli_main(["export", str(run_dir), str(tmp_path / "b"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert weights_digest(tiny_llama) in err and "0" * 64 in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_debug_commands_validation_and_traces_work_on_a_lora_run(
    ray_session, val_data, tiny_llama, tmp_path, capsys
):
    from sft_runtime.traces.spans import STEP_SPAN, VALIDATION_SPAN
    from sft_runtime.traces.tree import find_job_trace, find_step_trace
    from tests.support.fixtures import val_overrides
    from tests.support.reliability import validations

    run_dir = tmp_path / "run"
    traced = ("telemetry.enabled=true", "telemetry.exporters=[jaeger_file]")
    extra = (*val_overrides(val_data), *traced, *SHARDED)
    config = small_config(run_dir, val_data, HF_STEPS, *_overrides(tiny_llama, *extra))
    assert run_training(config)["reason"] == "completed"
    passes = validations(run_dir)
    assert sorted(passes) == [0, 2, 4, 5]
    assert passes[5][0] < passes[0][0]  # the adapters lowered the validation loss
    assert cli_main(["samples", str(run_dir), "--step", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    scratch = tmp_path / "scratch"
    args = ["reproduce", str(run_dir), "--step", "3", "--to", "5", "--scratch", str(scratch)]
    assert cli_main(args) == 0
    assert "identical: steps 3..5 reproduce bit for bit" in capsys.readouterr().out
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    assert cli_main(["diff", str(run_dir), str(copy)]) == 0
    job, _ = find_job_trace(run_dir)
    assert [s["operationName"] for s in job["spans"]].count(VALIDATION_SPAN) == 4
    step, trace, executions = find_step_trace(run_dir, 3)
    assert step["operationName"] == STEP_SPAN and executions == 1
    assert len({s["processID"] for s in trace["spans"]}) >= 3  # the controller and 2 workers


def test_a_bfloat16_base_sharded_beside_float32_adapters_trains_and_resumes(
    ray_session, demo_data, tiny_llama, tmp_path
):
    """FSDP2 over a frozen bf16 base and float32 adapters (the mixed dtypes of one unit), as
    examples/lora.yaml runs: it trains, saves adapters only, and its checkpoint resumes."""
    extra = (*SHARDED, "policy.precision=bfloat16")
    run_dir = tmp_path / "run"
    config = small_config(run_dir, demo_data, 2, *_overrides(tiny_llama, *extra))
    assert run_training(config)["reason"] == "completed"
    losses = [loss for loss, _ in committed(run_dir).values()]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)
    saved = load_weights(run_dir, 2)
    assert saved and all(is_adapter(n) and t.dtype == torch.float32 for n, t in saved.items())
    config = small_config(run_dir, demo_data, 3, *_overrides(tiny_llama, *extra))
    assert run_training(config)["reason"] == "completed"
    assert sorted(committed(run_dir)) == [1, 2, 3]

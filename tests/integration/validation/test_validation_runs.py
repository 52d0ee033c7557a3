"""Validation in real runs (Ray workers, energon, the controller): what it measures, what it
leaves alone, and how it ranks checkpoints.

- Training with validation on commits the losses and samples of the run without it, bit for
  bit (`reference`: the same config and training data, validation off).
- The validation loss of the same weights is the same with DP 1, DP 2 and FSDP (1e-6), over
  the same samples (one digest).
- ``keep_top_k: 2`` by ``val:val_loss`` keeps the two best checkpoints and the newest, each
  ranked by the latest validation at its step.
- With a Hugging Face model the validation loss equals an independent computation: the
  checkpoint's weights loaded by transformers, the validation chats rendered by the
  tokenizer's own chat template with its assistant mask, mean NLL over those tokens (1e-5).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from sft_runtime.events.lineage import records_in_effect
from sft_runtime.events.log import read_log
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.traces.spans import VALIDATION_SPAN, VALIDATION_WORKER_SPAN
from sft_runtime.traces.tree import find_job_trace, tag_value
from tests.support.fixtures import HF_STEPS, VAL_SAMPLES, hf_overrides, val_overrides
from tests.support.reliability import FSDP, STEPS, committed, validations
from tests.support.small_run import small_config


@pytest.fixture(scope="module")
def validated(ray_session, val_data, tmp_path_factory) -> Path:
    """The reliability suite's shared run with validation on and a checkpoint every step,
    the best two by validation loss kept (plus the newest)."""
    run_dir = tmp_path_factory.mktemp("validated") / "run"
    config = small_config(
        run_dir,
        val_data,
        STEPS,
        *val_overrides(val_data),
        "checkpointing.save_period=1",
        "checkpointing.metric_name=val:val_loss",
        "checkpointing.keep_top_k=2",
        "telemetry.enabled=true",
        "telemetry.exporters=[jaeger_file]",
    )
    assert run_training(config)["reason"] == "completed"
    return run_dir


def test_validation_leaves_training_exactly_as_it_was(validated, reference, capsys):
    assert committed(validated) == reference.committed  # losses and samples, bit for bit
    passes = validations(validated)
    assert sorted(passes) == [0, 2, 4, 6, 7]  # at the start, every 2 steps, at the end
    losses = [passes[s][0] for s in sorted(passes)]
    assert losses[-1] < losses[0]  # it measures the training
    assert {p[1:] for p in passes.values()} == {next(iter(passes.values()))[1:]}  # same samples
    rows = [json.loads(line) for line in (validated / "metrics.jsonl").read_text().splitlines()]
    val_rows = {r["step"]: r["val"] for r in rows if "val" in r}
    assert {s: v["val_loss"] for s, v in val_rows.items()} == {s: p[0] for s, p in passes.items()}
    assert cli_main(["verify", str(validated)]) == 0
    capsys.readouterr()
    assert cli_main(["events", str(validated)]) == 0
    assert "0, 2, 4, 6, 7" in capsys.readouterr().out  # the attempt's validated steps
    assert cli_main(["replay", str(validated), "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["last_validation"] == {"step": 7, "val_loss": passes[7][0]}


def test_each_validation_is_a_span_with_a_child_per_worker(validated):
    trace, _ = find_job_trace(validated)
    spans = trace["spans"]
    passes = [s for s in spans if s["operationName"] == VALIDATION_SPAN]
    assert sorted(tag_value(s, "step") for s in passes) == [0, 2, 4, 6, 7]
    for parent in passes:
        children = [
            s
            for s in spans
            if s["operationName"] == VALIDATION_WORKER_SPAN
            and any(r["spanID"] == parent["spanID"] for r in s.get("references") or ())
        ]
        assert sorted(tag_value(c, "rank") for c in children) == [0, 1]


def test_keep_top_k_by_validation_loss_keeps_the_two_best_and_the_newest(validated):
    saved = [
        r.data["step"]
        for r in records_in_effect(read_log(validated))
        if r.type == "checkpoint_saved"
    ]
    assert saved == list(range(1, STEPS + 1))
    passes = validations(validated)
    # a save ranks by the latest validation at its step (an odd step has none of its own)
    metric = {s: passes[max(v for v in passes if v <= s)][0] for s in saved}
    best = sorted(saved, key=lambda s: (metric[s], -s))[:2]
    kept = sorted(
        int(p.name.removeprefix("step_")) for p in (validated / "checkpoints").glob("step_*")
    )
    assert kept == sorted({*best, saved[-1]}) and len(kept) < len(saved)
    for step in kept:
        info = json.loads(
            (validated / "checkpoints" / f"step_{step}" / "training_info.json").read_text()
        )
        assert info["metric"] == metric[step] and info["metric_name"] == "val:val_loss"


@pytest.mark.parametrize("layout", ["dp1", "fsdp"])
def test_the_validation_loss_does_not_depend_on_the_layout(
    layout, ray_session, val_data, validated, tmp_path
):
    """The initial weights (the same on every layout), validated before any step."""
    layout_overrides = {"dp1": ("cluster.workers_per_node=1",), "fsdp": FSDP}[layout]
    config = small_config(
        tmp_path / "run", val_data, 1, *val_overrides(val_data), *layout_overrides
    )
    assert run_training(config)["reason"] == "completed"
    ours, theirs = validations(tmp_path / "run")[0], validations(validated)[0]
    assert ours[1:] == theirs[1:]  # tokens, samples and their digest
    assert ours[0] == pytest.approx(theirs[0], rel=1e-6, abs=0)


def _val_chats(data: Path) -> list[list[dict[str, str]]]:
    chats = []
    for shard in sorted(data.glob("val-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    chats.append(json.loads(tar.extractfile(member).read())["messages"])
    return chats


def _independent_val_loss(model_dir: Path, tokenizer_dir: Path, chats: list) -> tuple[float, int]:
    """Mean NLL over the assistant tokens, as transformers alone computes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, tokens = 0.0, 0
    for chat in chats:
        out = tokenizer.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor([out["input_ids"]])
        mask = torch.tensor(out["assistant_masks"][1:], dtype=torch.float64)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].double()
        token_nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        nll += float((token_nll * mask).sum())
        tokens += int(mask.sum())
    return nll / tokens, tokens


def test_the_validation_loss_of_a_hugging_face_model_is_transformers_own(
    ray_session, val_data, tiny_qwen2, tmp_path
):
    run_dir = tmp_path / "run"
    config = small_config(
        run_dir,
        val_data,
        HF_STEPS,
        *hf_overrides(tiny_qwen2),
        *val_overrides(val_data, period=100),  # at the start and at the end
        "data.max_input_seq_length=256",  # no validation chat is cut
    )
    assert run_training(config)["reason"] == "completed"
    passes = validations(run_dir)
    assert sorted(passes) == [0, HF_STEPS]
    chats = _val_chats(val_data)
    assert len(chats) == VAL_SAMPLES and passes[0][2] == VAL_SAMPLES
    weights = run_dir / "checkpoints" / f"step_{HF_STEPS}" / "policy" / "weights"
    for step, model_dir in ((0, tiny_qwen2), (HF_STEPS, weights)):
        loss, tokens = _independent_val_loss(model_dir, tiny_qwen2, chats)
        assert passes[step][1] == tokens, step
        assert passes[step][0] == pytest.approx(loss, rel=1e-5, abs=0), step
    assert passes[HF_STEPS][0] < passes[0][0]

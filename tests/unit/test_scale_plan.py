"""bench/scale_plan.py, the 70B plan: its parameter list is the one transformers builds for
the same config, its JSON shows the sharded load needing about 1/ranks of the old whole-model
load per rank, and its event-log arithmetic gives the bytes a known file holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import scale_plan  # noqa: E402


def _built(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the transformers model, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_the_70b_count_is_what_transformers_builds_from_the_same_literal_config():
    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        head_dim=128,
        tie_word_embeddings=False,
    )
    built = _built(config)
    assert sum(torch.Size(s).numel() for s in built.values()) == 70_553_706_496
    assert scale_plan.parameter_count(scale_plan.LLAMA_31_70B) == 70_553_706_496
    # the same tensors under the same names: the row slices and export files are counted on it
    assert dict(scale_plan.tensors(scale_plan.LLAMA_31_70B)) == built


def test_a_tiny_tied_config_with_biases_is_counted_by_the_same_formula():
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        head_dim=16,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    shape = scale_plan.LlamaShape(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        head_dim=16,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    built = _built(config)
    assert dict(scale_plan.tensors(shape)) == built
    assert scale_plan.parameter_count(shape) == sum(torch.Size(s).numel() for s in built.values())


def test_the_json_plan_shows_the_sharded_load_at_about_one_rank_s_share():
    done = subprocess.run(
        [sys.executable, "bench/scale_plan.py", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    load = {key: r["value"] for key, r in plan["load"].items()}
    ranks = 64
    assert plan["parameters"]["total"]["value"] == 70_553_706_496
    assert load["whole_per_rank"] == pytest.approx(70_553_706_496 * 4 / 2**30)
    # no rank can hold less than 1/ranks of the float32 model; the slice in flight is small
    assert load["sharded_per_rank"] * ranks >= load["whole_per_rank"]
    assert load["whole_per_rank"] / load["sharded_per_rank"] >= 0.9 * ranks
    assert load["whole_per_node"] == pytest.approx(8 * load["whole_per_rank"])


def _line(record: dict) -> bytes:
    return json.dumps(record).encode() + b"\n"


def test_bytes_per_step_of_a_known_log_and_its_growth_with_the_rank_count(tmp_path, capsys):
    digest = "0123456789abcdef0123456789abcdef"  # 32 hex characters, as the runtime writes
    lines = [_line({"seq": 0, "type": "run_started", "data": {"host": "h"}})]
    for step, count in ((1, 2), (2, 2), (3, 4)):
        data = {"step": step, "loss": 1.5, "sample_digests": [digest] * count}
        lines.append(_line({"seq": step, "type": "step_committed", "data": data}))
    lines.append(_line({"seq": 4, "type": "checkpoint_saved", "data": {"step": 3}}))
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"".join(lines))
    total = sum(len(line) for line in lines)

    measured = scale_plan.measure_log(log)
    assert (measured.steps, measured.total_bytes, measured.digests) == (3, total, 8)
    assert measured.digest_bytes == 8 * (32 + 2 + 1)  # quotes and a comma each
    assert measured.per_step() == pytest.approx(total / 3)
    # 64 ranks: each step carries 64 digests where this log's steps carried 8/3 on average
    assert measured.per_step_at(64) == pytest.approx(total / 3 + (64 - 8 / 3) * 35)

    assert scale_plan.main(["--json", "--log", str(log), "--steps", "1000"]) == 0
    section = json.loads(capsys.readouterr().out)["log"]
    assert section["per_step"]["value"] == pytest.approx(total / 3 + (64 - 8 / 3) * 35)
    assert section["total_mb"]["value"] == pytest.approx(1000 * section["per_step"]["value"] / 1e6)


def test_a_log_without_step_records_is_refused(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_bytes(_line({"seq": 0, "type": "run_started", "data": {}}))
    with pytest.raises(ValueError, match="no step_committed"):
        scale_plan.measure_log(log)

"""A key left out gets the value NeMo RL's base ``sft.yaml`` gives it.

The file in tests/support/nemo_rl is NeMo RL's own, key for key. Every leaf of it that is a
default (not the example's model, data set or the names derived from them) is compared with
what a config that leaves the key out reads as. The few that differ are listed here with
the reason, and each listed one must still differ, so the list cannot go stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sft_runtime.runtime.config import MasterConfig, validate_config
from sft_runtime.runtime.config_files.loader import read_config

NEMO_RL = Path(__file__).resolve().parents[2] / "support" / "nemo_rl" / "sft.yaml"

# The example's own choices, not defaults: its model, its data set and what names them.
EXAMPLE = (
    "policy.model_name",
    "policy.tokenizer.",
    "data.train.",
    "data.validation.",
    "data.default.",
    "logger.wandb.",
    "logger.swanlab.",
    "logger.mlflow.",
    "policy.megatron_cfg.",  # accepted disabled as a block; no Megatron here
    "policy.dynamic_batching.train_mb_tokens",  # null: NeMo RL's interpolation (below)
    "policy.sequence_packing.train_mb_tokens",
    "policy.dtensor_cfg._v2",  # read as `v2`
)

# Where a key left out means something else here, and why (README: Coming from NeMo RL).
DIFFERENT = {
    # one folder per run holds its log, metrics, traces and checkpoints (resume reads both)
    "checkpointing.checkpoint_dir": None,
    # a run reaches a third-party service only when asked
    "logger.wandb_enabled": False,
    # a folder inside the run directory
    "logger.tensorboard.log_dir": "tensorboard",
}


def _leaves(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _read(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node[part]
    return node


def _minimal(**data: Any) -> MasterConfig:
    """Only what NeMo RL has no default for: the model and the data."""
    return validate_config(
        {
            "policy": {"model_name": "/models/any"},
            "data": {"train": {"dataset_name": "openai_format", "data_path": "/d/t.jsonl"}} | data,
        }
    )


def _defaults() -> list[tuple[str, Any]]:
    nemo = _leaves(read_config(NEMO_RL))
    return [(k, v) for k, v in nemo.items() if not k.startswith(EXAMPLE)]


@pytest.mark.parametrize(("key", "nemo_rl"), _defaults(), ids=[k for k, _ in _defaults()])
def test_a_key_left_out_reads_as_nemo_rls_base_config(key, nemo_rl, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # NeMo RL's 1 GPU a node
    validation = {"validation": {"dataset_name": "openai_format", "data_path": "/d/v.jsonl"}}
    ours = _read(_minimal(**validation).model_dump(by_alias=True), key)
    if key in DIFFERENT:
        assert ours == DIFFERENT[key] != nemo_rl
    else:
        assert ours == nemo_rl


def test_without_validation_data_the_default_schedule_validates_nothing():
    """NeMo RL skips validation when it has no validation set; so does its default here,
    while a schedule the user sets without data is refused (test_validation_rules)."""
    config = _minimal()
    assert config.sft.val_period == 0 and not config.sft.val_at_start
    assert config.checkpointing.metric_name is None


def test_on_a_machine_without_a_gpu_the_workers_are_cpu_processes(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    config = _minimal()
    assert config.cluster.gpus_per_node == 0 and config.cluster.world_size == 2


def test_the_built_in_model_follows_the_default_length():
    config = validate_config(
        {"data": {"train": {"dataset_name": "openai_format", "data_path": "/d/t.jsonl"}}}
    )
    assert config.data.max_input_seq_length == 1024 == config.policy.model.max_seq_len

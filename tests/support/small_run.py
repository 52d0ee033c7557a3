"""The small run config shared by the controller tests (conftest module names clash).

It states every value the tests rely on where NeMo RL's default (what a key left out gets)
would differ: float32 without FSDP, this runtime's rows, no validation at step 0, every
checkpoint kept, CPU workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sft_runtime.runtime.config import MasterConfig, validate_config
from sft_runtime.runtime.config_files.overrides import apply_override


def small_raw(run_dir: Path, data_dir: Path, steps: int = 6) -> dict[str, Any]:
    return {
        "policy": {
            "model": {
                "vocab_size": 264,
                "d_model": 32,
                "n_layers": 1,
                "n_heads": 2,
                "max_seq_len": 64,
            },
            "train_global_batch_size": 8,
            "train_micro_batch_size": 2,
            "optimizer": {"kwargs": {"lr": 3e-3}},
            "make_sequence_length_divisible_by": 8,
            "precision": "float32",
            "dtensor_cfg": {"enabled": False},
            "sequence_packing": {"algorithm": "first_fit_decreasing"},
        },
        "data": {
            "max_input_seq_length": 64,
            "overlong_samples": "truncate",  # most demo chats run past 64 tokens
            "train": {"path": str(data_dir), "virtual_epoch_length": 32},
            "num_workers": 0,
            "add_bos": False,
            "add_generation_prompt": True,
            "energon": {"shuffle_buffer_size": None},
        },
        "sft": {
            "max_num_steps": steps,
            "max_num_epochs": 5,
            "seed": 7,
            # a test that adds validation data picks its own schedule and batches
            "val_at_start": False,
            "val_batches": None,
            "val_global_batch_size": None,
            "val_micro_batch_size": None,
        },
        "logger": {"log_dir": str(run_dir), "tensorboard_enabled": False, "monitor_gpus": False},
        "cluster": {
            "gpus_per_node": 0,
            "workers_per_node": 2,
            "cpus_per_worker": 0.5,
            "call_timeout_s": 120,
        },
        "checkpointing": {
            "enabled": True,
            "save_period": 3,
            "metric_name": "train:loss",
            "keep_top_k": None,
        },
    }


def small_config(run_dir: Path, data_dir: Path, steps: int = 6, *overrides: str) -> MasterConfig:
    raw = small_raw(run_dir, data_dir, steps)
    for item in overrides:
        apply_override(raw, item)
    return validate_config(raw)

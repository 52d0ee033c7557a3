"""`sft-runtime demo`: a real pretrained chat model learns a new identity in a few minutes.

SmolLM2-135M-Instruct (fetched once into the user's cache, `runtime.models.demo_model`) is
fine-tuned with LoRA on 2 data-parallel workers on chats that call the assistant "Quill,
made by Inkwell Labs" (`runtime.data.identity_chats`), prepared by the same path as any
user's data (``prepare-data --tokenizer``: every chat rendered by the model's own template).
The run validates, checkpoints, writes its event log and traces like any other; its last
checkpoint is exported as a model folder (adapters merged), and greedy replies to prompts
that no training chat contains are printed before and after: the new identity shows on
them, and "What is the capital of France?" is still answered right.

LoRA rather than a full fine-tune: on 2 CPU cores it learns this in about 8 steps of 16
chats, its checkpoints hold 4.9M parameters instead of 134.5M, and the frozen base keeps
what the model knew. The config is `pretrained_demo_config` (mirrored by
examples/demo_smollm2.yaml).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sft_runtime.runtime.cli.demo import DEMO_CLUSTER
from sft_runtime.runtime.config import MasterConfig, validate_config

DEFAULT_STEPS = 12
DEFAULT_RUN_DIR = Path("runs/demo-smollm2")
TRAIN_CHATS, VAL_CHATS = 288, 32


def pretrained_demo_config(
    run_dir: Path | str, data_dir: Path | str, model_dir: Path | str, steps: int = DEFAULT_STEPS
) -> MasterConfig:
    """The demo's run: LoRA on every linear layer, 2 workers, 16 chats a step."""
    raw: dict[str, Any] = {
        "policy": {
            "model_name": str(model_dir),
            "precision": "bfloat16",  # the frozen base in bf16, the adapters in fp32
            "dtensor_cfg": {
                "enabled": False,  # whole replicas: 135M parameters fit every worker
                "lora_cfg": {"enabled": True, "dim": 16, "alpha": 32, "match_all_linear": True},
            },
            "train_global_batch_size": 16,
            "train_micro_batch_size": 8,
            "max_grad_norm": 1.0,
            "optimizer": {
                "kwargs": {"lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
            },
            "make_sequence_length_divisible_by": 8,
        },
        "data": {
            "max_input_seq_length": 256,
            "train": {"path": str(data_dir), "virtual_epoch_length": TRAIN_CHATS // 16},
            "validation": {"path": str(data_dir)},
            "num_workers": 0,
            "add_bos": False,
            "add_generation_prompt": True,  # the assistant header is context
            "energon": {"shuffle_buffer_size": None},
        },
        "sft": {
            "max_num_steps": steps,
            "max_num_epochs": 100,
            "seed": 42,
            "val_period": 6,
            "val_at_start": False,  # the completions before training show the start
            "val_at_end": True,
            "val_batches": None,  # the whole held-out split
            "val_global_batch_size": 16,
            "val_micro_batch_size": 8,
        },
        "logger": {"log_dir": str(run_dir), "monitor_gpus": False},
        "cluster": dict(DEMO_CLUSTER),
        "checkpointing": {"enabled": True, "save_period": 6, "metric_name": "val:val_loss"},
        "telemetry": {"enabled": True, "exporters": ["jaeger_file"]},
    }
    return validate_config(raw, source="demo config")


def prepare_identity_data(data_dir: Path, model_dir: Path, say: Callable[[str], None]) -> None:
    """The identity chats as an energon data set with a val split, every chat rendered by
    the model's chat template first (`prepare-data --tokenizer`)."""
    from sft_runtime.runtime.data.identity_chats import write_identity_jsonl
    from sft_runtime.runtime.data.prepare import prepare_jsonl

    total = TRAIN_CHATS + VAL_CHATS
    source = write_identity_jsonl(data_dir.parent / "identity_chats.jsonl", total, seed=0)
    result = prepare_jsonl(
        source, data_dir, shard_size=96, val_fraction=VAL_CHATS / total, tokenizer=model_dir
    )
    say(
        f"prepared {result.num_train} train and {result.num_val} val chats from {source} "
        f"(each rendered by the model's chat template) in {data_dir}"
    )


def run_pretrained_demo(
    args: argparse.Namespace,
    train: Callable[..., int],
    budget: Callable[[Path, int], int],
) -> int:
    """Fetch, prepare, ask, train, export, ask again. `train` runs a config with progress
    (the CLI's), `budget` says how many steps the run dir's run should reach."""
    from rich.console import Console

    from sft_runtime.runtime.data.identity_chats import HELD_OUT_PROMPTS, MAKER, NAME
    from sft_runtime.runtime.models.demo_model import fetch_demo_model
    from sft_runtime.runtime.models.generate import greedy_replies

    console = Console()
    say = console.print
    from sft_runtime.runtime.launch.run_dirs import check_dir_to_create

    run_dir = args.run_dir or DEFAULT_RUN_DIR
    steps = args.steps or DEFAULT_STEPS
    check_dir_to_create(run_dir, "--run-dir")
    say(f"fine-tuning SmolLM2-135M-Instruct to answer as {NAME}, made by {MAKER} (LoRA)")
    model_dir = fetch_demo_model(args.model_dir, progress=say)
    data_dir = run_dir / "data"
    if not (data_dir / ".nv-meta").is_dir():
        prepare_identity_data(data_dir, model_dir, say)
    config = pretrained_demo_config(run_dir, data_dir, model_dir, budget(run_dir, steps))
    say("asking the base model the held-out prompts (greedy) ...")
    before = greedy_replies(model_dir, HELD_OUT_PROMPTS)
    code = train(config, console=console)
    exported = _export_newest(run_dir, say)
    if exported is None:
        return code
    after = greedy_replies(exported, HELD_OUT_PROMPTS)
    say("prompts no training chat contains, greedy replies (before -> after):")
    for prompt, old, new in zip(HELD_OUT_PROMPTS, before, after, strict=True):
        say(f"  {prompt!r}", markup=False)
        say(f"      before: {old!r}", markup=False)
        say(f"      after:  {new!r}", markup=False)
    return code


def _export_newest(run_dir: Path, say: Callable[[str], None]) -> Path | None:
    """The newest checkpoint as a model folder with the adapters merged
    (``sft-runtime export RUN_DIR OUT --merge``), made once per checkpoint."""
    from sft_runtime.runtime.checkpoint.recorded import checkpoint_store
    from sft_runtime.runtime.export.hf_export import export_checkpoint

    steps = checkpoint_store(run_dir).steps()
    if not steps:
        return None
    out = run_dir / "exported" / f"step_{steps[-1]}"
    if not (out / "config.json").is_file():
        export_checkpoint(run_dir, out, step=steps[-1], merge=True)
        say(f"exported step_{steps[-1]} (adapters merged) to {out}")
    return out

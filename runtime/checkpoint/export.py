"""`export_checkpoint`: one checkpoint of a Hugging Face run as a standalone model folder.

A checkpoint's ``policy/weights`` is already a model folder, but it sits inside a run and
beside optimizer and RNG files a user does not ship. The export writes weights (optionally
cast, say to bfloat16 for serving), ``config.json`` saying that dtype,
``generation_config.json`` and the tokenizer into one folder that ``from_pretrained`` and
``generate`` use directly, or that a new run names as ``policy.model.hf_path``.

Nothing half-written is ever taken for an export: the folder is built under a temporary name,
fsynced and renamed. A checkpoint that is incomplete, damaged, or not of an HF model is refused
(`UserInputError`, exit 2) before anything is written. A sharded (FSDP2) checkpoint is
consolidated here, in one process, so its export is the same model folder at any world size.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from sft_runtime.events.log import fsync_dir
from sft_runtime.runtime.checkpoint import policy_files
from sft_runtime.runtime.checkpoint.store import CheckpointDir, fsync_tree
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy.hf_model import own_names

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_checkpoint(
    run_dir: Path,
    out: Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
    checkpoint_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> Path:
    """Write checkpoint ``step`` (default: the newest) of ``run_dir`` to ``out``."""
    store = CheckpointDir(checkpoint_dir or Path(run_dir) / "checkpoints")
    where = _checkpoint(store, step)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"{out}: exists and is not an empty folder; choose a new OUT")
    store.info(int(where.name.removeprefix("step_")))  # refuses a missing/damaged info file
    _require_hf_run(where)
    weights = where / "policy" / "weights"
    if not (weights / "config.json").is_file():
        raise UserInputError(f"{weights}: no config.json; the checkpoint is incomplete")
    progress(f"reading {weights}")
    tensors = policy_files.load_weights(str(weights))  # sharded ones consolidated
    tensors = _check_names(weights, tensors)
    target = DTYPES[dtype] if dtype else None
    if target is not None:
        tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        progress(f"writing {len(tensors)} tensors ({dtype or 'as saved'})")
        policy_files.save_weights(str(tmp), tensors)
        _write_config(weights / "config.json", tmp / "config.json", dtype)
        if (weights / "generation_config.json").is_file():
            shutil.copyfile(weights / "generation_config.json", tmp / "generation_config.json")
        tokenizer = where / "policy" / "tokenizer"
        if tokenizer.is_dir():
            for file in sorted(tokenizer.iterdir()):
                shutil.copyfile(file, tmp / file.name)
        fsync_tree(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"exported {where.name} to {out}")
    return out


def _checkpoint(store: CheckpointDir, step: int | None) -> Path:
    steps = store.steps()
    if not steps:
        raise UserInputError(f"{store.root}: no complete checkpoint (step_<N>) to export")
    if step is None:
        return store.path(steps[-1])
    if step not in steps:
        raise UserInputError(f"{store.path(step)}: no such checkpoint; complete ones: {steps}")
    return store.path(step)


def _require_hf_run(where: Path) -> None:
    config_file = where / "config.yaml"
    try:
        config = yaml.safe_load(config_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError(f"{config_file}: unreadable ({exc})") from None
    kind = ((config.get("policy") or {}).get("model") or {}).get("kind", "transformer")
    if kind != "hf":
        raise UserInputError(
            f"{where}: trained policy.model.kind {kind!r}; export writes Hugging Face model "
            "folders, so it needs a run of kind 'hf'"
        )


def _check_names(weights: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors are exactly the model's own (tied duplicates may be left out, and are, as
    `save_pretrained` leaves them out): built on the meta device from config.json, so no
    memory is spent on it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(weights, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = set(model.state_dict())
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied = set(tied) if getattr(config, "tie_word_embeddings", False) else set()
    missing, unexpected = expected - set(tensors) - tied, set(tensors) - expected
    if missing or unexpected:
        raise UserInputError(
            f"{weights}: the weights do not match config.json (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    own = set(own_names(model))
    return {k: v for k, v in tensors.items() if k in own}


def _write_config(source: Path, dest: Path, dtype: str | None) -> None:
    config = json.loads(source.read_text())
    if dtype is not None:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    dest.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

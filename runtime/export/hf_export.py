"""`export_checkpoint`: one checkpoint of a Hugging Face run as a standalone model folder.

A checkpoint's ``policy/weights`` is already a model folder, but it sits inside a run and
beside optimizer and RNG files a user does not ship. The export writes weights (optionally
cast, say to bfloat16 for serving), ``config.json`` saying that dtype,
``generation_config.json`` and the tokenizer into one folder that ``from_pretrained`` and
``generate`` use directly, or that a new run names as ``policy.model_name``.

The weights stream: they are read a few tensors at a time (`WeightReader`, from a
safetensors folder or the rank files of a sharded FSDP2 checkpoint), cast, and written as
safetensors shards of at most ``max_shard_size`` bytes with ``model.safetensors.index.json``,
as `save_pretrained` lays them out. The process therefore holds about one shard, not the
model, and a sharded checkpoint of any world size exports to the same folder.

Nothing half-written is ever taken for an export: the folder is built under a temporary name,
fsynced and renamed; a temporary folder left by a killed export is removed by the next one. A
checkpoint that is incomplete, damaged, or not of an HF model is refused (`UserInputError`,
exit 2) before anything is written.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from sft_runtime.events.log import fsync_dir
from sft_runtime.runtime.checkpoint.layout import check_layout
from sft_runtime.runtime.checkpoint.recorded import checkpoint_store
from sft_runtime.runtime.checkpoint.store import CheckpointDir, fsync_tree
from sft_runtime.runtime.checkpoint.weight_reader import WeightReader
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.export.lora_export import adapter_writer, merged_writer
from sft_runtime.runtime.export.shards import (
    DTYPES,
    cast,
    copy_tokenizer,
    plan_shards,
    tokenizer_files,
    write_config,
    write_shards,
)
from sft_runtime.runtime.lora.base import read_base_record
from sft_runtime.runtime.policy.hf_model import own_names
from sft_runtime.runtime.process.liveness import pid_alive

DEFAULT_MAX_SHARD_SIZE = "5GB"  # as `save_pretrained`
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size as transformers writes them: ``5GB`` (10**9), ``500MiB`` (2**20),
    or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise UserInputError(
            f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB"
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def export_checkpoint(
    run_dir: Path,
    out: Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
    checkpoint_dir: Path | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    merge: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Path:
    """Write checkpoint ``step`` (default: the newest) of ``run_dir`` to ``out``, in
    safetensors files of at most ``max_shard_size`` (``5GB``, ``500MB``, or bytes). A LoRA
    checkpoint becomes peft's adapter folder, or with ``merge`` its base with the adapters
    merged in (`runtime.export.lora_export`)."""
    store = checkpoint_store(run_dir, checkpoint_dir=checkpoint_dir)  # where the log says
    where = _checkpoint(store, step)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"{out}: exists and is not an empty folder; choose a new OUT")
    store.info(int(where.name.removeprefix("step_")))  # refuses a missing/damaged info file
    _require_hf_run(where)
    check_layout(where, parts=("weights",))  # as its config.yaml says; metadata read safely
    weights = where / "policy" / "weights"
    tokenizer = where / "policy" / "tokenizer"
    tokenizer_files(tokenizer)  # a link among them is refused before anything is written
    limit = parse_size(max_shard_size)
    record = read_base_record(weights)
    if record is not None:  # adapters: peft's folder, or merged into their base
        write = (merged_writer if merge else adapter_writer)(
            weights, tokenizer, record, dtype, limit, progress
        )
    elif merge:
        raise UserInputError(
            f"--merge: {where} is a full fine-tune's checkpoint; it has no adapters to merge "
            "(export it without --merge)"
        )
    else:
        write = _model_writer(weights, tokenizer, dtype, limit, progress)
    _publish(out, write)
    progress(f"exported {where.name} to {out}")
    return out


def _model_writer(
    weights: Path,
    tokenizer: Path,
    dtype: str | None,
    limit: int,
    progress: Callable[[str], None],
) -> Callable[[Path], None]:
    """The whole model's folder from a full fine-tune's checkpoint (checked here, written
    when called)."""
    if not (weights / "config.json").is_file():
        raise UserInputError(f"{weights}: no config.json; the checkpoint is incomplete")
    reader = WeightReader(weights)
    names = _check_names(weights, set(reader.specs))
    target = DTYPES[dtype] if dtype else None
    shards = plan_shards(reader, names, target, limit)

    def write(folder: Path) -> None:
        write_shards(lambda part: cast(reader.read(part), target), shards, folder, progress)
        write_config(weights / "config.json", folder / "config.json", dtype)
        if (weights / "generation_config.json").is_file():
            shutil.copyfile(weights / "generation_config.json", folder / "generation_config.json")
        copy_tokenizer(tokenizer, folder)

    return write


def _publish(out: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a temporary folder beside ``out``, fsynced, then renamed to ``out``:
    a killed export leaves no folder under the final name (and the next removes its tmp)."""
    _remove_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        fsync_tree(tmp)
        if out.exists():
            out.rmdir()  # empty, checked before
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale(out: Path) -> None:
    """Temporary folders of earlier exports to ``out`` whose process is gone (killed)."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


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
    if not (config.get("policy") or {}).get("model_name"):
        raise UserInputError(
            f"{where}: trained the built-in transformer (no policy.model_name); export writes "
            "Hugging Face model folders, so it needs a run of a Hugging Face model"
        )


def _check_names(weights: Path, names: set[str]) -> list[str]:
    """The tensors are exactly the model's own (tied duplicates may be left out, and are, as
    `save_pretrained` leaves them out): built on the meta device from config.json, so no
    memory is spent on it. Returns the names to write, in the model's order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(weights, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = set(model.state_dict())
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied = set(tied) if getattr(config, "tie_word_embeddings", False) else set()
    missing, unexpected = expected - names - tied, names - expected
    if missing or unexpected:
        raise UserInputError(
            f"{weights}: the weights do not match config.json (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    return [name for name in own_names(model) if name in names]

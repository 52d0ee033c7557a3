"""A LoRA checkpoint exported: peft's adapter folder, or the base with the adapters merged.

`adapter_writer` writes what ``PeftModel.from_pretrained(base, folder)`` reads:
``adapter_config.json`` (peft's own config, naming the base), ``adapter_model.safetensors``
under peft's names, and the tokenizer. The adapters are small, so they are read whole.

`merged_writer` writes a full model folder that ``AutoModelForCausalLM.from_pretrained``
loads with no peft installed: each weight of the base, read from the base's own folder a
shard at a time, plus ``alpha/dim * B @ A`` for a layer that was adapted, computed in float32.
The base must be the one the adapters were trained on: its digest is checked against the
checkpoint's record first, since merging into another base writes a plausible, wrong model.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sft_runtime.runtime.checkpoint.weight_reader import WeightReader
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.export.shards import (
    DTYPES,
    cast,
    copy_tokenizer,
    plan_shards,
    write_config,
    write_shards,
)
from sft_runtime.runtime.lora.adapters import ADAPTER, is_adapter, peft_config, peft_key
from sft_runtime.runtime.lora.base import BASE_FILE, base_folder, weights_digest
from sft_runtime.runtime.lora.config import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _adapters(weights: Path) -> dict[str, torch.Tensor]:
    reader = WeightReader(weights)
    names = list(reader.specs)
    if not names or not all(is_adapter(n) for n in names):
        raise UserInputError(
            f"{weights}: {BASE_FILE} says LoRA, but the weights are not adapters only"
        )
    return reader.read(names)


def adapter_writer(
    weights: Path,
    tokenizer: Path,
    record: dict[str, Any],
    dtype: str | None,
    limit: int,
    progress: Callable[[str], None],
) -> Callable[[Path], None]:
    """peft's adapter folder of the checkpoint (checked here, written when called)."""
    del limit  # adapters are one small file
    lora = LoraConfig.model_validate(record["lora"])
    config = peft_config(lora, record["target_modules"], base=record["base_model"])
    adapters = _adapters(weights)

    def write(folder: Path) -> None:
        tensors = {peft_key(n): t for n, t in cast(adapters, DTYPES.get(dtype or "")).items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        progress(f"writing {ADAPTER_WEIGHTS} ({len(tensors)} tensors, {size / 1e6:.1f} MB)")
        save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(str(folder))
        copy_tokenizer(tokenizer, folder)

    return write


def merged_writer(
    weights: Path,
    tokenizer: Path,
    record: dict[str, Any],
    dtype: str | None,
    limit: int,
    progress: Callable[[str], None],
) -> Callable[[Path], None]:
    """The base with the adapters merged, as a model folder (checked here, written when
    called); float32 unless ``dtype``."""
    base = base_folder(record["base_model"])
    if not base.is_dir():
        raise UserInputError(
            f"--merge: the base {record['base_model']!r} the adapters were trained on is not "
            "a folder here; merging needs its weights"
        )
    digest = weights_digest(base)
    if digest != record["base_digest"]:
        raise UserInputError(
            f"--merge: the weights in {base} (digest {digest}) are not the base the adapters "
            f"were trained on (digest {record['base_digest']}, in {weights / BASE_FILE})"
        )
    scaling = LoraConfig.model_validate(record["lora"]).scaling
    adapters = _adapters(weights)
    deltas = {}  # base weight name -> (A, B)
    for module in record["target_modules"]:
        a = adapters[f"{module}.lora_A.{ADAPTER}.weight"]
        b = adapters[f"{module}.lora_B.{ADAPTER}.weight"]
        deltas[f"{module}.weight"] = (a, b)
    reader = WeightReader(base)
    missing = sorted(set(deltas) - set(reader.specs))
    if missing:
        raise UserInputError(f"{base}: holds no {missing[0]}, which the adapters were made for")
    target = DTYPES[dtype] if dtype else torch.float32
    names = list(reader.specs)
    shards = plan_shards(reader, names, target, limit)

    def read(part: list[str]) -> dict[str, torch.Tensor]:
        tensors = reader.read(part)
        for name in part:
            if name in deltas:
                a, b = deltas[name]
                tensors[name] = tensors[name].float() + scaling * (b @ a)
        return cast(tensors, target)

    def write(folder: Path) -> None:
        write_shards(read, shards, folder, progress)
        write_config(base / "config.json", folder / "config.json", dtype or "float32")
        if (base / "generation_config.json").is_file():
            shutil.copyfile(base / "generation_config.json", folder / "generation_config.json")
        copy_tokenizer(tokenizer, folder)
        progress(f"merged {len(deltas)} adapted layers (scale {scaling:g}) into {base}'s weights")

    return write

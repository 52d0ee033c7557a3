"""What every export writes the same way: safetensors shards, one in memory at a time, the
index that names them, a config saying the stored dtype, the tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from sft_runtime.runtime.checkpoint.policy_files import WEIGHTS_FILE, WEIGHTS_INDEX, shard_names
from sft_runtime.runtime.checkpoint.weight_reader import WeightReader
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.process.faults import fault_point

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cast(tensors: dict[str, torch.Tensor], target: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating tensors as ``target`` (None: as they are); integer buffers keep theirs."""
    if target is None:
        return tensors
    return {n: t.to(target) if t.is_floating_point() else t for n, t in tensors.items()}


def plan_shards(
    reader: WeightReader, names: list[str], target: torch.dtype | None, limit: int
) -> list[list[str]]:
    """Tensor names in the model's order, cut into files of at most ``limit`` bytes as
    written (a larger tensor is a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = reader.nbytes(name, target)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_shards(
    read: Callable[[list[str]], dict[str, torch.Tensor]],
    shards: list[list[str]],
    folder: Path,
    progress: Callable[[str], None],
) -> int:
    """Each shard read (``read`` gives its tensors as they are to be stored) and written in
    turn, only one in memory; the index when there are several. Returns the bytes written."""
    files = [WEIGHTS_FILE] if len(shards) == 1 else shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for k, (file, names) in enumerate(zip(files, shards, strict=True), start=1):
        tensors = read(names)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        progress(f"writing {file} ({k}/{len(shards)}, {len(names)} tensors, {size / 1e6:.1f} MB)")
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(names, file))
        total += size
        fault_point("export:after_shard", step=k)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    progress(f"{total / 1e9:.2f} GB in {len(shards)} file(s)")
    return total


def write_config(source: Path, dest: Path, dtype: str | None) -> None:
    """``config.json`` as the source has it, saying ``dtype`` when the weights were cast."""
    config = json.loads(source.read_text())
    if dtype is not None:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    dest.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def tokenizer_files(tokenizer: Path) -> list[Path]:
    """The checkpoint's tokenizer files, sub-folders' included, relative to ``tokenizer``.

    A link anywhere (the folder itself included) is refused: it may name any file of this
    machine, which the export would copy into a folder meant to be shipped; so is anything
    that is not a plain file or folder."""
    if tokenizer.is_symlink():
        raise UserInputError(f"{tokenizer}: is a link; export copies only the checkpoint's files")
    if not tokenizer.is_dir():
        return []
    files: list[Path] = []
    for root, dirs, names in os.walk(tokenizer):  # links to folders are listed, not entered
        for name in sorted(dirs) + sorted(names):
            path = Path(root) / name
            if path.is_symlink():
                raise UserInputError(
                    f"{path}: is a link; export copies only the checkpoint's own files (put "
                    "the file itself there, or remove the link)"
                )
            if path.is_file():
                files.append(path.relative_to(tokenizer))
            elif not path.is_dir():
                raise UserInputError(f"{path}: not a regular file; export copies only files")
    return sorted(files)


def copy_tokenizer(tokenizer: Path, folder: Path) -> None:
    """The checkpoint's tokenizer files beside the weights (as on the hub), sub-folders
    kept; a file the export already wrote (config.json, a weights shard) is never replaced."""
    for relative in tokenizer_files(tokenizer):
        dest = folder / relative
        if dest.exists():
            raise UserInputError(
                f"{tokenizer / relative}: would replace the export's own {relative}; a "
                "tokenizer folder holds tokenizer files only"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer / relative, dest, follow_symlinks=False)

"""`export_checkpoint`: one checkpoint of a Hugging Face run as a standalone model folder.

A checkpoint's ``policy/weights`` is already a model folder, but it sits inside a run and
beside optimizer and RNG files a user does not ship. The export writes weights (optionally
cast, say to bfloat16 for serving), ``config.json`` saying that dtype,
``generation_config.json`` and the tokenizer into one folder that ``from_pretrained`` and
``generate`` use directly, or that a new run names as ``policy.model.hf_path``.

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

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from sft_runtime.events.log import fsync_dir
from sft_runtime.runtime.checkpoint.policy_files import WEIGHTS_FILE, WEIGHTS_INDEX, shard_names
from sft_runtime.runtime.checkpoint.store import CheckpointDir, fsync_tree
from sft_runtime.runtime.checkpoint.weight_reader import WeightReader
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy.hf_model import own_names
from sft_runtime.runtime.process.faults import fault_point
from sft_runtime.runtime.process.liveness import pid_alive

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
    progress: Callable[[str], None] = lambda _: None,
) -> Path:
    """Write checkpoint ``step`` (default: the newest) of ``run_dir`` to ``out``, in
    safetensors files of at most ``max_shard_size`` (``5GB``, ``500MB``, or bytes)."""
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
    reader = WeightReader(weights)
    names = _check_names(weights, set(reader.specs))
    target = DTYPES[dtype] if dtype else None
    shards = _plan_shards(reader, names, target, parse_size(max_shard_size))
    _remove_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        total = _write_shards(reader, shards, target, tmp, progress)
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
    progress(f"{total / 1e9:.2f} GB in {len(shards)} file(s)")
    progress(f"exported {where.name} to {out}")
    return out


def _plan_shards(
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


def _write_shards(
    reader: WeightReader,
    shards: list[list[str]],
    target: torch.dtype | None,
    folder: Path,
    progress: Callable[[str], None],
) -> int:
    """Each shard read, cast and written in turn (only one in memory); the index when there
    are several. Returns the bytes written."""
    files = [WEIGHTS_FILE] if len(shards) == 1 else shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for k, (file, names) in enumerate(zip(files, shards, strict=True), start=1):
        tensors = reader.read(names)
        if target is not None:
            tensors = {n: t.to(target) if t.is_floating_point() else t for n, t in tensors.items()}
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
    return total


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
    kind = ((config.get("policy") or {}).get("model") or {}).get("kind", "transformer")
    if kind != "hf":
        raise UserInputError(
            f"{where}: trained policy.model.kind {kind!r}; export writes Hugging Face model "
            "folders, so it needs a run of kind 'hf'"
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


def _write_config(source: Path, dest: Path, dtype: str | None) -> None:
    config = json.loads(source.read_text())
    if dtype is not None:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    dest.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

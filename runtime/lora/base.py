"""Which frozen base a LoRA checkpoint belongs to, and the proof that it is still that base.

A LoRA checkpoint holds the adapters and their optimizer state only: its weights mean
nothing without the base they were trained on. So beside them it records the base's path
(or hub id) and a digest of its weight files (``lora.json``), and a resume compares that
digest with the base it is given: adapters trained on one base and resumed on another would
train on silently, bit for bit reproducible and wrong.

The digest is SHA-256 over each weight file's name and bytes (``*.safetensors``, the index,
``*.bin``), in name order: a base re-saved with other bytes, or with a shard more, differs;
the tokenizer and config files do not count, as they hold no weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from sft_runtime.runtime.errors import UserInputError

BASE_FILE = "lora.json"
BASE_FORMAT = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")
_CHUNK = 16 * 2**20


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def base_folder(path: str | os.PathLike) -> Path:
    """The base's folder: the path itself, or a hub id's snapshot in the local cache (where
    the workers' `from_pretrained` put it)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception:  # noqa: BLE001 - not a folder, nor a cached hub model
        return folder


def weights_digest(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of the base folder's weight files (see the module docstring)."""
    folder = base_folder(path)
    files = weight_files(folder) if folder.is_dir() else []
    if not files:
        raise UserInputError(f"policy.model_name {str(path)!r}: no weight files to digest")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def base_record(base: str, digest: str, targets: list[str], lora: dict[str, Any]) -> bytes:
    """The bytes of ``lora.json``: the base, its digest, the adapted layers, the config."""
    record = {
        "format": BASE_FORMAT,
        "base_model": base,
        "base_digest": digest,
        "target_modules": targets,
        "lora": lora,
    }
    return json.dumps(record, indent=2, sort_keys=True).encode()


def read_base_record(weights_dir: Path) -> dict[str, Any] | None:
    """A LoRA checkpoint's ``lora.json``; None for a checkpoint of a full fine-tune."""
    path = Path(weights_dir) / BASE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_bytes())
    except ValueError as exc:
        raise UserInputError(f"{path}: unreadable ({exc})") from None
    if record.get("format") != BASE_FORMAT:
        raise UserInputError(f"{path}: unknown format {record.get('format')!r}")
    return record


def check_base(weights_dir: Path, lora_enabled: bool, hf_path: str | None) -> None:
    """A resume's checkpoint and config agree on LoRA, and the base is the one trained on."""
    record = read_base_record(weights_dir)
    if record is None:
        if lora_enabled:
            raise UserInputError(
                f"{weights_dir}: a full fine-tune's checkpoint, but "
                "policy.dtensor_cfg.lora_cfg.enabled=true; "
                "resume without LoRA, or export it and start a LoRA run from the export"
            )
        return
    if not lora_enabled:
        raise UserInputError(
            f"{weights_dir}: a LoRA checkpoint (adapters of {record['base_model']}), but "
            "policy.dtensor_cfg.lora_cfg.enabled=false; resume with "
            "policy.dtensor_cfg.lora_cfg.enabled=true"
        )
    assert hf_path is not None
    digest = weights_digest(hf_path)
    if digest != record["base_digest"]:
        raise UserInputError(
            f"policy.model_name {hf_path!r}: its weights (digest {digest}) are not the base "
            f"the checkpoint's adapters were trained on ({record['base_model']!r}, digest "
            f"{record['base_digest']}, in {weights_dir / BASE_FILE})"
        )

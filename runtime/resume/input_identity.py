"""What a path in the config stands for, by content: a data set or model folder moved or
copied elsewhere is the same input, one changed in place is not.

A resume compares these identities, not the paths (`config_change.py`), and every checkpoint
records those of its run (``input_identities`` in training_info.json), so the comparison
still works once the old path is gone. Each is cheap: metadata files (up to 64 MiB) are
hashed, tar shards and weights count by name and size, which is what a copy keeps and a
re-prepared data set or another model does not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sft_runtime.runtime.resume.config_keys import IDENTITY_KEYS

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
_MODEL_ONLY = ("config.json", "generation_config.json")
# the HF config keys that say where or how a folder was written, not what the model is
_NOT_ARCHITECTURE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
_TRANSIENT = ("-journal", "-wal", "-shm")  # sqlite's files beside energon's index


def _digest(parts: dict[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


_HASHED_UP_TO = 64 << 20  # larger files (a big data set's index.sqlite) count by size


def _file_sha(path: Path) -> str:
    size = path.stat().st_size
    if size > _HASHED_UP_TO:
        return f"size:{size}"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def data_set_identity(path: str | Path) -> str | None:
    """An energon data set: its ``.nv-meta`` files' bytes and its shards' names and sizes
    (None when the folder is not a prepared data set)."""
    root = Path(path).expanduser()
    meta = root / ".nv-meta"
    if not meta.is_dir():
        return None
    files = {
        p.name: _file_sha(p)
        for p in sorted(meta.iterdir())
        if p.is_file() and not p.name.endswith(_TRANSIENT)
    }
    try:
        names = list(json.loads((meta / ".info.json").read_text())["shard_counts"])
    except (OSError, KeyError, TypeError, ValueError):
        names = [str(p.relative_to(root)) for p in sorted(root.rglob("*.tar"))]
    shards = {name: _size(root / name) for name in names}
    return _digest({"nv-meta": files, "shards": shards})


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def model_config_identity(path: str) -> str | None:
    """A Hugging Face model: its ``config.json`` without the keys that say where it was
    saved (a hub id stands for itself; None when a local folder has no config.json)."""
    from sft_runtime.runtime.policy.model_path import is_local

    if not is_local(path):
        return f"hub:{path}"
    file = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return _digest({k: v for k, v in config.items() if k not in _NOT_ARCHITECTURE})


def tokenizer_identity(path: str) -> str | None:
    """A Hugging Face tokenizer folder: every file but the weights and the model's config
    (None when there is no such folder)."""
    from sft_runtime.runtime.policy.model_path import is_local

    if not is_local(path):
        return f"hub:{path}"
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    files = {
        p.name: _file_sha(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name not in _MODEL_ONLY
    }
    return _digest(files)


_IDENTITY_OF = {
    "data set": data_set_identity,
    "model config": model_config_identity,
    "tokenizer": tokenizer_identity,
}


def input_identities(flat: dict[str, Any]) -> dict[str, str]:
    """``{key: identity}`` for every path key of a flattened config that names something
    readable (`IDENTITY_KEYS`)."""
    out = {}
    for key, what in IDENTITY_KEYS.items():
        value = flat.get(key)
        if isinstance(value, str) and value:
            identity = _IDENTITY_OF[what](value)
            if identity is not None:
                out[key] = identity
    return out


def config_identities(config: Any) -> dict[str, str]:
    """`input_identities` of a whole run config (a `MasterConfig`), as each checkpoint
    records them."""
    from sft_runtime.runtime.resume.config_keys import config_leaves, flatten

    return input_identities(flatten(config.model_dump(mode="json"), config_leaves()))

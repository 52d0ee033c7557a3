"""Where a model comes from (a folder, or a hub id) and its `transformers` config, without torch.

The driver reads these before Ray starts and the controller names the model's inputs for
resume checks; neither process trains, so neither should import torch to ask.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sft_runtime.runtime.errors import UserInputError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_local(path: str) -> bool:
    """A folder on disk (or something meant as one), rather than a hub id like ``org/name``."""
    return Path(path).exists() or not _HUB_ID.match(path) or path.startswith((".", "/", "~"))


def hf_config(path: str) -> Any:
    """The model's `transformers` config, read before anything is built (errors name the key)."""
    from transformers import AutoConfig

    if is_local(path):
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise UserInputError(f"policy.model_name {path!r}: no such model folder")
        if not (folder / "config.json").is_file():
            raise UserInputError(
                f"policy.model_name {path!r}: no config.json (not a Hugging Face model folder)"
            )
    try:
        return AutoConfig.from_pretrained(path, local_files_only=is_local(path))
    except (OSError, ValueError, KeyError) as exc:
        raise UserInputError(f"policy.model_name {path!r}: unreadable config ({exc})") from None

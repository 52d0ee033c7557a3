"""A checkpoint's files are laid out as its own ``config.yaml`` says they were written.

``policy.dtensor_cfg.enabled`` decides whether ``policy/weights`` and ``policy/optimizer`` are
torch.distributed.checkpoint folders (``.metadata`` and rank files) or a safetensors folder
and ``optimizer.pt``. A folder of the other kind was not written by the run that made the
checkpoint: a ``.metadata`` dropped beside unsharded weights would make every reader take
them for sharded ones. Every command that reads a checkpoint's weights (export, samples,
reproduce, resume) checks this first, and reads a sharded folder's metadata here through the
allow-list (`safe_dcp`), so that a crafted one is refused before Ray starts or anything is
written. torch is imported only for a sharded folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from sft_runtime.runtime.checkpoint.sharded import METADATA, is_sharded
from sft_runtime.runtime.errors import UserInputError

CONFIG_NAME = "config.yaml"
PARTS = ("weights", "optimizer")


def saved_fsdp(checkpoint: Path) -> bool | None:
    """``policy.dtensor_cfg.enabled`` as the checkpoint's config.yaml records it (None when the
    checkpoint has no config.yaml; a missing key is the default, false)."""
    path = Path(checkpoint) / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError(f"{path}: unreadable ({exc})") from None
    node = raw
    for key in ("policy", "dtensor_cfg"):
        node = node.get(key) if isinstance(node, dict) else None
    value = node.get("enabled", False) if isinstance(node, dict) else False
    if not isinstance(value, bool):
        raise UserInputError(
            f"{path}: policy.dtensor_cfg.enabled must be true or false, got {value!r}"
        )
    return value


def check_layout(checkpoint: Path, parts: tuple[str, ...] = PARTS) -> None:
    """``policy/<part>`` of ``checkpoint`` is sharded exactly when its config.yaml says
    ``policy.dtensor_cfg.enabled: true``, and a sharded one's metadata reads through the
    allow-list; raises `UserInputError` naming the folder (or the file and the global)."""
    fsdp = saved_fsdp(checkpoint)
    config = Path(checkpoint) / CONFIG_NAME
    for part in parts:
        folder = Path(checkpoint) / "policy" / part
        if not folder.is_dir():
            continue
        sharded = is_sharded(folder)
        if fsdp is not None and sharded and not fsdp:
            raise UserInputError(
                f"{folder}: holds a sharded (torch.distributed.checkpoint) {METADATA}, but "
                f"{config} says policy.dtensor_cfg.enabled=false: the run did not write it; remove "
                "the stray file or restore the checkpoint"
            )
        if fsdp and not sharded:
            raise UserInputError(
                f"{folder}: no {METADATA}, but {config} says policy.dtensor_cfg.enabled=true: the "
                "sharded checkpoint is incomplete"
            )
        if sharded:
            from sft_runtime.runtime.checkpoint.safe_dcp import read_metadata

            read_metadata(folder)

"""The config's relative paths, made absolute where the user launched the run.

A config names folders relative to where the user stands (NeMo RL's ``logs``,
``results/sft``, a model folder beside the script), but the controller and the workers are
Ray processes whose working directory is Ray's, not the driver's: a Ray instance started
earlier, elsewhere, or on another node would read and write somewhere else. The driver
resolves them once, before anything leaves its process. A hub id (``Qwen/Qwen2.5-0.5B``)
names no local path and is left as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sft_runtime.runtime.config import MasterConfig


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().absolute())


def _local(name: str | None) -> str | None:
    """A model or tokenizer name that is a local folder, made absolute; a hub id as given."""
    if name is None or name == "byte" or not Path(name).expanduser().exists():
        return name
    return _absolute(name)


def with_absolute_paths(config: MasterConfig) -> MasterConfig:
    """`config` with its relative folders resolved against the current directory."""
    data = config.data
    updates: dict[str, Any] = {
        "logger": config.logger.model_copy(
            update={"log_dir": _absolute(config.logger.log_dir or ".")}
        ),
        "checkpointing": config.checkpointing.model_copy(
            update={"checkpoint_dir": _absolute(config.checkpointing.checkpoint_dir)}
        ),
        "policy": config.policy.model_copy(
            update={
                "model_name": _local(config.policy.model_name),
                "tokenizer": config.policy.tokenizer.model_copy(
                    update={"name": _local(config.policy.tokenizer.name)}
                ),
            }
        ),
    }
    sets = {"train": data.train.model_copy(update={"path": _absolute(data.train.path)})}
    if data.validation is not None:
        sets["validation"] = data.validation.model_copy(
            update={"path": _absolute(data.validation.path)}
        )
    updates["data"] = data.model_copy(update=sets)
    return config.model_copy(update=updates)

"""The ``checkpointing`` section: when checkpoints are written, which are kept, and how.

Beside the checkpointer it configures, as every component keeps its own section; the run
config (`runtime.config.MasterConfig`) only assembles them.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sft_runtime.runtime.metrics.step_metrics import STEP_METRIC_KEYS
from sft_runtime.runtime.validation.config import VAL_METRIC_KEYS, VAL_PREFIX

_DEADLINE = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


class CheckpointingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    checkpoint_dir: str | None = None  # default: <run_dir>/checkpoints
    save_period: int = Field(10, ge=0)
    ft_save_period: int = Field(0, ge=0)
    metric_name: str | None = None
    higher_is_better: bool = False
    keep_top_k: int | None = Field(3, ge=1)  # NeMo RL's; null keeps every checkpoint
    ft_keep_latest_k: int | None = Field(None, ge=1)
    checkpoint_must_save_by: str | None = None  # "DD:HH:MM:SS" after the controller starts
    save_optimizer: bool = True
    background_writes: bool = True  # workers write while the next steps train
    # resume even though keys that decide a step changed since the checkpoint (recorded in
    # run_started); `train --allow-config-change` sets it for one launch (config_change.py)
    allow_config_change: bool = False

    @field_validator("metric_name")
    @classmethod
    def _train_metric(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(VAL_PREFIX):
            if value.removeprefix(VAL_PREFIX) not in VAL_METRIC_KEYS:
                known = ", ".join(VAL_PREFIX + key for key in VAL_METRIC_KEYS)
                raise ValueError(f"{value!r} is not a validation metric; available: {known}")
            return value
        if value is not None and (not value.startswith("train:") or value == "train:"):
            raise ValueError(
                "must be null, 'train:<metric>' (for example 'train:loss') or "
                f"'val:<metric>' (for example 'val:val_loss'), got {value!r}"
            )
        if value is not None and value.removeprefix("train:") not in STEP_METRIC_KEYS:
            known = ", ".join(f"train:{key}" for key in sorted(STEP_METRIC_KEYS))
            raise ValueError(f"{value!r} is not a training metric; available: {known}")
        return value

    @field_validator("checkpoint_must_save_by")
    @classmethod
    def _deadline(cls, value: str | None) -> str | None:
        if value is not None:
            parse_deadline(value)
        return value

    @property
    def deadline_seconds(self) -> float | None:
        return (
            None
            if self.checkpoint_must_save_by is None
            else parse_deadline(self.checkpoint_must_save_by)
        )


def parse_deadline(text: str) -> float:
    """'DD:HH:MM:SS' -> seconds."""
    match = _DEADLINE.match(text)
    if not match:
        raise ValueError(f"must look like DD:HH:MM:SS (for example 00:03:45:00), got {text!r}")
    days, hours, minutes, seconds = map(int, match.groups())
    if hours > 23 or minutes > 59 or seconds > 59:
        raise ValueError(f"hours < 24, minutes and seconds < 60 in {text!r}")
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)

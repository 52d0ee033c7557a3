"""The validation keys (NeMo RL's ``sft.val_*`` names) resolved into one `ValidationSpec`.

The spec is what every worker needs to run its share of a validation pass and nothing it does
not: plain values, picklable, no torch, so the controller builds it and the config rules run
before Ray starts. When validation runs is the run's `ValidationSchedule` (`validation_schedule`),
which `StepRules.after` reads: one rule for the loop, the machine and a resume alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from sft_runtime.runtime.data.chat_format import RENDERED_FORMAT, ChatFormat
from sft_runtime.runtime.data.config import DataConfig, OverlongPolicy
from sft_runtime.runtime.data.integrity import split_shards
from sft_runtime.runtime.data.tokenizer import TokenizerSpec
from sft_runtime.states.rules import ValidationSchedule

VAL_METRIC_KEYS = ("val_loss", "val_tokens", "val_samples", "val_time")
VAL_PREFIX = "val:"  # checkpointing.metric_name "val:val_loss"


class ValidationSpec(BaseModel):
    """One validation pass: which samples (the first ``num_samples`` of the split in their
    stored order, or all of them), how they are rendered, and how they are batched."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_path: str
    split: str = "val"
    tokenizer: TokenizerSpec = TokenizerSpec()
    max_input_seq_length: int = Field(..., ge=2)
    pad_multiple: int = Field(1, ge=1)
    only_unmask_final: bool = False
    overlong_samples: OverlongPolicy = "mask"
    skip_bad_samples: bool = False
    chat_format: ChatFormat = RENDERED_FORMAT  # the config's data.add_bos, add_eos, ...prompt
    prompt: str | None = None  # data.validation.prompt_file's text
    global_batch_size: int = Field(..., ge=1)
    micro_batch_size: int = Field(..., ge=1)
    num_samples: int | None = Field(None, ge=1)  # None: the whole split


# What the rules read of the run config. `MasterConfig` is assembled in runtime/config.py,
# above this folder, and runs these rules, so they name it by what they read: plain keys as
# attributes, sections and computed values as read-only properties (which MasterConfig's
# own section types satisfy).


class _SFTKeys(Protocol):
    val_period: int
    val_at_start: bool
    val_at_end: bool
    val_batches: int | None
    val_global_batch_size: int | None
    val_micro_batch_size: int | None
    only_unmask_final: bool

    @property
    def model_fields_set(self) -> set[str]: ...


class _PolicyKeys(Protocol):
    tokenizer: TokenizerSpec
    train_global_batch_size: int
    train_micro_batch_size: int
    make_sequence_length_divisible_by: int


class _CheckpointingKeys(Protocol):
    metric_name: str | None


class _ClusterKeys(Protocol):
    @property
    def world_size(self) -> int: ...


class RunConfig(Protocol):
    """The sections of the run config the validation rules read (`MasterConfig` is one)."""

    @property
    def sft(self) -> _SFTKeys: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def policy(self) -> _PolicyKeys: ...
    @property
    def checkpointing(self) -> _CheckpointingKeys: ...
    @property
    def cluster(self) -> _ClusterKeys: ...


def has_validation_data(config: RunConfig) -> bool:
    """A validation set named, or a held-out part of the train file."""
    data = config.data
    held_out = data.train.data_path is not None and data.train.split_validation_size > 0
    return data.validation is not None or held_out


def validation_enabled(config: RunConfig) -> bool:
    """NeMo RL validates when it has a validation set and a schedule; without one its
    default schedule does nothing (a schedule the user sets is refused by the rules)."""
    sft = config.sft
    scheduled = bool(sft.val_period or sft.val_at_start or sft.val_at_end)
    return scheduled and has_validation_data(config)


def validation_spec(config: RunConfig) -> ValidationSpec | None:
    """The pass this run's workers run, or None when the run never validates."""
    if not validation_enabled(config) or config.data.validation is None:
        return None
    sft, data, policy = config.sft, config.data, config.policy
    gbs = sft.val_global_batch_size or policy.train_global_batch_size
    return ValidationSpec(
        data_path=data.validation.path,
        split=data.validation.split,
        tokenizer=policy.tokenizer,
        max_input_seq_length=data.max_input_seq_length,
        pad_multiple=policy.make_sequence_length_divisible_by,
        only_unmask_final=sft.only_unmask_final,
        overlong_samples=data.overlong_samples,
        skip_bad_samples=data.skip_bad_samples,
        chat_format=data.chat_format,
        prompt=data.validation.prompt("validation"),
        global_batch_size=gbs,
        micro_batch_size=sft.val_micro_batch_size or policy.train_micro_batch_size,
        num_samples=sft.val_batches * gbs if sft.val_batches else None,
    )


def check_validation(config: RunConfig) -> None:
    """The rules a validation setting must keep, each naming its key (ValueError)."""
    sft, data, ck = config.sft, config.data, config.checkpointing
    enabled = validation_enabled(config)
    asked = [
        k
        for k in ("val_period", "val_at_start", "val_at_end")
        if k in sft.model_fields_set and getattr(sft, k)
    ]
    if asked and not has_validation_data(config):
        key = asked[0]
        raise ValueError(
            f"sft.{key} is set but data.validation is null: give data.validation.path (a "
            "prepared data set; `prepare-data --val-fraction` writes a 'val' split), "
            "data.validation.data_path (a JSONL file) or data.train.split_validation_size"
        )
    if ck.metric_name and ck.metric_name.startswith(VAL_PREFIX) and not enabled:
        raise ValueError(
            f"checkpointing.metric_name {ck.metric_name!r}: no validation runs in this config "
            "(set sft.val_period, sft.val_at_start or sft.val_at_end)"
        )
    if not enabled:
        return
    world = config.cluster.world_size
    gbs = sft.val_global_batch_size or config.policy.train_global_batch_size
    mbs = sft.val_micro_batch_size or config.policy.train_micro_batch_size
    if gbs % (world * mbs):
        raise ValueError(
            f"sft.val_global_batch_size={gbs} must be a multiple of data-parallel size {world} "
            f"x sft.val_micro_batch_size={mbs}"
        )
    if data.validation is not None and data.validation.path is not None:
        _check_split(data.validation.path, data.validation.split)  # a data_path: prepared later


def _check_split(path: str, split: str) -> None:
    folder = Path(path).expanduser()
    if not (folder / ".nv-meta").is_dir():
        raise ValueError(
            f"data.validation.path {path!r}: not a prepared energon data set (no .nv-meta; "
            "run `sft-runtime prepare-data`)"
        )
    try:
        shards = split_shards(folder, split)
    except Exception:  # noqa: BLE001 - any unreadable split file means the same to the user
        shards = []
    if not shards:
        raise ValueError(
            f"data.validation.split {split!r}: {path} has no such split (prepare it with "
            "`sft-runtime prepare-data --val-fraction`)"
        )


def validation_schedule(config: RunConfig) -> ValidationSchedule:
    """The run's schedule of validation passes (never, without validation data)."""
    sft = config.sft
    if not validation_enabled(config) or config.data.validation is None:
        return ValidationSchedule()
    return ValidationSchedule(sft.val_period or 0, sft.val_at_start, sft.val_at_end)

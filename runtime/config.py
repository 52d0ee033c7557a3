"""`MasterConfig`: the run config, loaded from YAML with dotted overrides, checked early.

Every rule that needs no cluster runs here, before `ray.init`, and fails with a message
that names the dotted key and the fix; the CLI turns it into exit code 2. Each section is
the config of one builder in `runtime/` (policy workers, loaders, checkpoints, logger).
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from sft_runtime.runtime.checkpoint.config import CheckpointingConfig
from sft_runtime.runtime.checkpoint.store import CheckpointDir
from sft_runtime.runtime.config_files.loader import read_config
from sft_runtime.runtime.data.config import (
    DataConfig,
    LoaderSpec,
    SequencePackingConfig,
    build_loader_spec,
)
from sft_runtime.runtime.data.tokenizer import TokenizerSpec
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.metrics.metrics_log import LoggerConfig
from sft_runtime.runtime.policy.cluster_config import ClusterConfig
from sft_runtime.runtime.policy.config import (
    STRICT,
    PolicyConfig,
    check_batch_layout,
    check_dynamic_batching,
)
from sft_runtime.runtime.validation.config import (
    check_validation,
    has_validation_data,
    validation_enabled,
    validation_schedule,
)
from sft_runtime.states import StepRules
from sft_runtime.traces.config import TelemetryConfig

NEMO_RL_SEQUENCE_LENGTH = 1024  # policy.max_total_sequence_length in NeMo RL's sft.yaml
NEMO_RL_METRIC = "val:val_loss"  # checkpointing.metric_name in NeMo RL's sft.yaml


class PolicySection(PolicyConfig):
    """The ``policy`` section: the worker's config plus tokenizer and sequence packing."""

    tokenizer: TokenizerSpec = TokenizerSpec()
    sequence_packing: SequencePackingConfig = SequencePackingConfig()

    @model_validator(mode="before")
    @classmethod
    def _model_tokenizer(cls, raw: Any) -> Any:
        """NeMo RL's ``tokenizer.name: ${policy.model_name}``: a model's own tokenizer unless
        another is named, so a block that only sets ``chat_template`` keeps it."""
        if not isinstance(raw, dict) or not raw.get("model_name"):
            return raw
        tokenizer = raw.get("tokenizer")
        if tokenizer is None:
            return {**raw, "tokenizer": {"name": raw["model_name"]}}
        if isinstance(tokenizer, dict) and tokenizer.get("name") is None:
            return {**raw, "tokenizer": {**tokenizer, "name": raw["model_name"]}}
        return raw


class SFTConfig(BaseModel):
    model_config = STRICT

    max_num_steps: int = Field(60, ge=1)
    max_num_epochs: int = Field(1, ge=1)
    seed: int = 42
    # NeMo RL's defaults; they validate only a config that has validation data (as NeMo RL
    # skips validation without a validation dataloader); one set without it is refused
    val_period: int = Field(10, ge=0)
    val_at_start: bool = True
    val_at_end: bool = False
    val_batches: int | None = Field(8, ge=0)  # 0 or null: the whole validation split
    val_global_batch_size: int | None = Field(32, ge=1)  # null: the training one's
    val_micro_batch_size: int | None = Field(1, ge=1)  # null: the training one's
    only_unmask_final: bool = False
    # A step whose loss or gradient norm is not finite never updates the weights. By default
    # the run then stops (exit 1) and resumes from its last checkpoint; true skips the update,
    # commits the step (its loss is recorded as it was) and counts it, as Megatron does.
    skip_nonfinite_steps: bool = False


class DataPlaneConfig(BaseModel):
    model_config = STRICT

    impl: Literal["local"] = "local"
    max_partitions: int = Field(1, ge=1)  # batches a worker may hold (>= 2 prefetches)
    # with max_partitions 1: read the next batch while the gradients are all-reduced
    load_during_allreduce: bool = True


class MasterConfig(BaseModel):
    """The whole run config. Sections are plain data; live objects never go in here."""

    model_config = STRICT

    # a factory, not an instance: building the default checks the optimizer with torch, which
    # importing the config (in the controller, say) should not pay for (190 MiB and seconds)
    policy: PolicySection = Field(default_factory=PolicySection)
    data: DataConfig
    sft: SFTConfig = Field(default_factory=SFTConfig)
    data_plane: DataPlaneConfig = DataPlaneConfig()
    logger: LoggerConfig = LoggerConfig()
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # GPUs seen when read
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    telemetry: TelemetryConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _length_from_policy(cls, raw: Any) -> Any:
        """NeMo RL's ``data.max_input_seq_length: ${policy.max_total_sequence_length}``
        (1024 when neither is given), as the default rather than an interpolation a user has
        to copy; the built-in model's ``max_seq_len`` left out follows it."""
        if not isinstance(raw, dict):
            return raw
        policy, data = raw.get("policy") or {}, raw.get("data")
        if not isinstance(policy, dict) or not isinstance(data, dict):
            return raw
        if "max_input_seq_length" not in data:
            longest = policy.get("max_total_sequence_length") or NEMO_RL_SEQUENCE_LENGTH
            data = {**data, "max_input_seq_length": longest}
        if policy.get("max_total_sequence_length") is None:
            policy = {**policy, "max_total_sequence_length": data["max_input_seq_length"]}
        model = policy.get("model") or {}
        if not policy.get("model_name") and isinstance(model, dict) and "max_seq_len" not in model:
            model = {**model, "max_seq_len": data["max_input_seq_length"]}
            policy = {**policy, "model": model}
        return {**raw, "policy": policy, "data": data}

    def _validation_defaults(self) -> None:
        """NeMo RL's validation schedule and checkpoint metric apply to a config that has
        validation data; without it a schedule left out is off. Written into the config, so
        a saved copy reads back the same."""
        sft, ck = self.sft, self.checkpointing
        if not has_validation_data(self):
            for key, off in (("val_period", 0), ("val_at_start", False)):
                if key not in sft.model_fields_set:
                    setattr(sft, key, off)
        elif "metric_name" not in ck.model_fields_set and validation_enabled(self):
            ck.metric_name = NEMO_RL_METRIC

    @model_validator(mode="after")
    def _rules(self) -> MasterConfig:
        data, policy = self.data, self.policy
        self._validation_defaults()
        check_validation(self)
        packing = policy.sequence_packing
        model = policy.model
        if packing.enabled and policy.is_hf and model.attn_implementation == "eager":
            raise ValueError(
                "policy.model.attn_implementation 'eager' would hold a T x T mask per packed "
                "row: use 'sdpa' (packed samples attend to themselves only, no mask) or set "
                "policy.sequence_packing.enabled=false"
            )
        longest = policy.max_total_sequence_length or data.max_input_seq_length
        budget = longest * policy.train_micro_batch_size
        if packing.enabled and packing.train_mb_tokens not in (None, budget):
            raise ValueError(
                f"policy.sequence_packing.train_mb_tokens={packing.train_mb_tokens}: a packed "
                "micro-batch here is policy.train_micro_batch_size rows of at most "
                f"policy.max_total_sequence_length tokens ({budget}, NeMo RL's default); set "
                f"it to {budget} or leave it out"
            )
        pad = policy.make_sequence_length_divisible_by
        if packing.enabled and data.max_input_seq_length % pad:
            raise ValueError(
                f"data.max_input_seq_length ({data.max_input_seq_length}) must be divisible by "
                f"policy.make_sequence_length_divisible_by ({pad}) when packing"
            )
        tokens = check_dynamic_batching(policy, data.max_input_seq_length, packing=packing.enabled)
        if tokens is not None:  # NeMo RL's default budget, written in so a saved copy says it
            dynamic = policy.dynamic_batching.model_copy(update={"train_mb_tokens": tokens})
            self.policy = policy = policy.model_copy(update={"dynamic_batching": dynamic})
        world = self.cluster.world_size  # every worker is one data-parallel rank
        check_shards(data.elastic.shards, world, policy)
        try:
            check_batch_layout(policy, world)
        except UserInputError as exc:
            raise ValueError(
                f"{exc} (the data-parallel size is cluster.num_nodes x "
                f"cluster.workers_per_node = {world})"
            ) from None
        if policy.is_hf and policy.tokenizer.is_byte:
            raise ValueError(
                "policy.tokenizer.name is 'byte' but policy.model_name trains on the model's "
                "own token ids: name a Hugging Face tokenizer (or leave policy.tokenizer.name "
                "out to take policy.model_name's)"
            )
        if not policy.is_hf and policy.model.max_seq_len < data.max_input_seq_length:
            raise ValueError(
                f"policy.model.max_seq_len ({policy.model.max_seq_len}) must be at least "
                f"data.max_input_seq_length ({data.max_input_seq_length})"
            )
        longest = policy.max_total_sequence_length
        if longest is not None and data.max_input_seq_length > longest:
            raise ValueError(
                f"data.max_input_seq_length ({data.max_input_seq_length}) is longer than "
                f"policy.max_total_sequence_length ({longest}), the longest row the policy "
                "trains on"
            )
        if self.cluster.num_nodes > 1 and self.checkpointing.enabled:
            ckpt = self.checkpointing.checkpoint_dir
            if ckpt is None or not Path(ckpt).is_absolute():
                raise ValueError(
                    "checkpointing.checkpoint_dir must be an absolute path on storage every "
                    "node sees when cluster.num_nodes > 1"
                )
        return self


def _max_train_steps(master_config: MasterConfig) -> int:
    sft = master_config.sft
    return min(
        sft.max_num_steps, sft.max_num_epochs * master_config.data.train.virtual_epoch_length
    )


# -- loading ------------------------------------------------------------------------------


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> MasterConfig:
    """Read a config file as NeMo RL does (its ``defaults:`` chain, ``_override_``,
    ``${...}`` interpolation, Hydra-style overrides: `config_files`), then validate. Errors
    name the file, the line or the key."""
    return validate_config(read_config(path, overrides), source=str(path))


def validate_config(raw: dict[str, Any], *, source: str = "config") -> MasterConfig:
    try:
        return MasterConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserInputError(f"{source}: invalid config\n  " + "\n  ".join(_explain(exc))) from None


def _explain(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc)
        if err["type"] == "extra_forbidden":
            hint = _nearest(loc)
            lines.append(f"{key}: unknown key" + (f" (did you mean {hint!r}?)" if hint else ""))
        elif err["type"] == "missing":
            lines.append(f"{key}: required")
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{key}: {msg}" if key else msg)
    return lines


def _nearest(loc: list[str]) -> str | None:
    """The closest valid key to the unknown last element of ``loc``."""
    model: Any = MasterConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = _model_of(field.annotation)
        if model is None:
            return None
    names = list(getattr(model, "model_fields", {}))
    match = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.5)
    return ".".join([*loc[:-1], match[0]]) if match else None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def check_shards(shards: int | None, world: int, policy: PolicyConfig) -> None:
    """``data.elastic.shards`` splits over the workers, and each shard's rows of a step make
    whole micro-batches (so none mixes two shards, on any number of workers)."""
    if shards is None:
        return
    if shards % world:
        raise ValueError(
            f"data.elastic.shards={shards}: the {world} data-parallel workers "
            "(cluster.num_nodes x cluster.workers_per_node) must divide it"
        )
    per_shard, rest = divmod(policy.train_global_batch_size, shards)
    if rest or per_shard % policy.train_micro_batch_size:
        raise ValueError(
            f"policy.train_global_batch_size={policy.train_global_batch_size} must be a "
            f"multiple of data.elastic.shards={shards} x "
            f"policy.train_micro_batch_size={policy.train_micro_batch_size}"
        )


def loader_spec(config: MasterConfig, logical_world_size: int) -> LoaderSpec:
    """The spec every loader owner of this run builds its loader from."""
    return build_loader_spec(
        config.data,
        global_batch_size=config.policy.train_global_batch_size,
        logical_world_size=logical_world_size,
        seed=config.sft.seed,
        packing=config.policy.sequence_packing,
        tokenizer=config.policy.tokenizer,
        make_sequence_length_divisible_by=config.policy.make_sequence_length_divisible_by,
        only_unmask_final=config.sft.only_unmask_final,
    )


def step_rules(config: MasterConfig, *, now: float) -> StepRules:
    """When this run saves and stops; a ``deadline_seconds`` counts from ``now``."""
    ck = config.checkpointing
    deadline = ck.deadline_seconds
    return StepRules(
        max_steps=_max_train_steps(config),
        save_period=ck.save_period,
        ft_save_period=ck.ft_save_period,
        checkpointing=ck.enabled,
        deadline=math.inf if deadline is None else now + deadline,
        validation=validation_schedule(config),
    )


def checkpoint_root(config: MasterConfig) -> Path:
    ckpt = config.checkpointing.checkpoint_dir
    return Path(ckpt) if ckpt else Path(config.logger.log_dir) / "checkpoints"


def run_checkpoints(config: MasterConfig) -> CheckpointDir:
    """The run's checkpoint directory with its retention rules."""
    ck = config.checkpointing
    return CheckpointDir(
        checkpoint_root(config),
        save_period=ck.save_period,
        keep_top_k=ck.keep_top_k,
        ft_keep_latest_k=ck.ft_keep_latest_k,
        higher_is_better=ck.higher_is_better,
    )

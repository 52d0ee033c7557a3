"""Config sections of the policy workers (model, optimizer, schedule, policy, cluster).

These are pydantic v2 models with ``extra="forbid"`` that `MasterConfig` composes under the
keys ``policy`` and ``cluster``. Static values live here; live objects (actors, tensors,
loader factories) never do. Checks that need only the config run in validators so a bad
file fails before Ray starts; `parse_section` turns pydantic's error into a
`UserInputError` whose message names the dotted key (``policy.optimizer.lr``), which the CLI
maps to exit code 2. The one check that needs the data-parallel size,
`check_batch_layout`, runs when the worker group is built.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.lora.config import LoraConfig

_Strict = ConfigDict(extra="forbid", allow_inf_nan=False)  # `lr: .inf` is bad input


class ModelConfig(BaseModel):
    """A small decoder-only transformer, or (``kind="hf"``) a pretrained HF causal LM (its
    sizes come from its own config.json; ``vocab_size`` and the like are ours only)."""

    model_config = _Strict

    kind: Literal["transformer", "hf"] = "transformer"
    vocab_size: int = Field(256, ge=2)
    d_model: int = Field(64, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    max_seq_len: int = Field(128, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    hf_path: str | None = None  # kind "hf": a local model folder or a hub id
    # kind "hf": how attention runs. sdpa runs packed rows a sample at a time with no mask
    # (packed_attention.py); eager is for unpacked rows only (packing refuses it)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"policy.model.d_model={self.d_model} must be divisible by "
                f"policy.model.n_heads={self.n_heads}"
            )
        if self.kind == "hf" and not self.hf_path:
            raise ValueError("policy.model.hf_path is required when policy.model.kind is 'hf'")
        return self


class OptimizerConfig(BaseModel):
    """AdamW hyper-parameters."""

    model_config = _Strict

    lr: float = Field(1e-3, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"policy.optimizer.betas={self.betas} must lie in [0, 1)")
        return self


class SchedulerConfig(BaseModel):
    """Linear warmup from 0, then a constant LR or a cosine decay to ``min_lr``."""

    model_config = _Strict

    kind: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, ge=1)
    min_lr: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        if self.kind == "cosine":
            if self.total_steps is None:
                raise ValueError("policy.scheduler.total_steps is required for kind 'cosine'")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"policy.scheduler.total_steps={self.total_steps} must exceed "
                    f"policy.scheduler.warmup_steps={self.warmup_steps}"
                )
        return self


class ParallelConfig(BaseModel):
    """How the model is spread over the data-parallel workers.

    ``fsdp: false`` (the default) keeps a whole replica on every worker. ``fsdp: true``
    shards parameters, gradients and optimizer state with FSDP2 (each decoder layer and the
    root ``fully_shard``ed over the workers' mesh), so a model larger than one device fits;
    ``replicate`` > 1 makes the mesh two-dimensional (replicate x shard, HSDP). The dtypes are
    FSDP2's `MixedPrecisionPolicy` (null: the parameters' own, float32).
    """

    model_config = _Strict

    fsdp: bool = False
    reshard_after_forward: bool = True
    param_dtype: Literal["float32", "bfloat16"] | None = None
    reduce_dtype: Literal["float32", "bfloat16"] | None = None
    activation_checkpointing: bool = False
    replicate: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if not self.fsdp:
            needs = [k for k in ("param_dtype", "reduce_dtype") if getattr(self, k) is not None]
            if self.replicate != 1:
                needs.append("replicate")
            if needs:
                raise ValueError(
                    f"policy.parallel.{needs[0]} is set but policy.parallel.fsdp is false: "
                    "set policy.parallel.fsdp=true or remove it"
                )
        return self


class PolicyConfig(BaseModel):
    """Everything a policy worker needs to build and train its replica."""

    model_config = _Strict

    model: ModelConfig = ModelConfig()
    tokenizer: dict | None = None
    train_global_batch_size: int = Field(8, ge=1)
    train_micro_batch_size: int = Field(2, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    make_sequence_length_divisible_by: int = Field(1, ge=1)
    precision: Literal["float32", "bfloat16"] = "float32"
    parallel: ParallelConfig = ParallelConfig()
    # adapters on a frozen base (runtime.lora); the base is then stored in `precision`
    lora: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _check(self) -> PolicyConfig:
        if self.lora.enabled and self.model.kind != "hf":
            raise ValueError(
                "policy.lora.enabled=true needs a pretrained Hugging Face model "
                "(policy.model.kind=hf and policy.model.hf_path): adapters fine-tune a "
                "frozen base, and the built-in transformer has none"
            )
        if self.train_global_batch_size % self.train_micro_batch_size != 0:
            raise ValueError(
                f"policy.train_global_batch_size={self.train_global_batch_size} must be a "
                f"multiple of policy.train_micro_batch_size={self.train_micro_batch_size}"
            )
        if self.scheduler.kind == "cosine" and self.scheduler.min_lr > self.optimizer.lr:
            raise ValueError(
                f"policy.scheduler.min_lr={self.scheduler.min_lr} exceeds "
                f"policy.optimizer.lr={self.optimizer.lr}"
            )
        return self


class ClusterConfig(BaseModel):
    """Where the workers run: one placement-group bundle per DP worker."""

    model_config = _Strict

    address: str | None = None
    num_nodes: int = Field(1, ge=1)
    workers_per_node: int = Field(2, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0.0)
    gpus_per_node: int = Field(0, ge=0)
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"
    num_threads_per_worker: int = Field(1, ge=1)
    dist_timeout_s: float = Field(60.0, gt=0.0)
    call_timeout_s: float = Field(300.0, gt=0.0)
    placement_timeout_s: float = Field(60.0, gt=0.0)
    connect_timeout_s: float = Field(10.0, gt=0.0)
    # Ray starts workers at niceness 15, so on a busy machine any other process starves the
    # controller and the training step; they run at this value where permitted (None keeps
    # Ray's). See process/niceness.py.
    worker_niceness: int | None = Field(0, ge=-20, le=19)

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.gpus_per_node not in (0, self.workers_per_node):
            raise ValueError(
                f"cluster.gpus_per_node={self.gpus_per_node} must be 0 (CPU) or equal "
                f"cluster.workers_per_node={self.workers_per_node} (one GPU per worker)"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.workers_per_node

    @property
    def gpus_per_worker(self) -> int:
        return 1 if self.gpus_per_node else 0


def check_batch_layout(policy: PolicyConfig, dp_size: int) -> int:
    """Rows each DP rank trains on per step; raises if the global batch does not split evenly."""
    per_rank, rest = divmod(policy.train_global_batch_size, dp_size)
    if rest or per_rank % policy.train_micro_batch_size:
        raise UserInputError(
            f"policy.train_global_batch_size={policy.train_global_batch_size} must be a "
            f"multiple of data-parallel size {dp_size} x "
            f"policy.train_micro_batch_size={policy.train_micro_batch_size}"
        )
    if policy.parallel.replicate > 1 and dp_size % policy.parallel.replicate:
        raise UserInputError(
            f"policy.parallel.replicate={policy.parallel.replicate} must divide the "
            f"data-parallel size {dp_size}"
        )
    return per_rank


_M = TypeVar("_M", bound=BaseModel)


def parse_section(model: type[_M], data: Any, prefix: str) -> _M:
    """Validate one section; errors become a `UserInputError` naming every dotted key."""
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise user_input_error(exc, prefix) from None


def user_input_error(exc: ValidationError, prefix: str) -> UserInputError:
    """Format a pydantic error as one line per problem, each led by its dotted key."""
    lines = []
    for err in exc.errors():
        key = ".".join([prefix, *(str(p) for p in err["loc"])]) if err["loc"] else prefix
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{key}: {msg}")
    return UserInputError("invalid config:\n  " + "\n  ".join(lines))

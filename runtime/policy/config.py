"""Config sections of the policy (model, optimizer, schedule, FSDP2, LoRA, batching).

These are pydantic v2 models with ``extra="forbid"`` that `MasterConfig` composes under the
key ``policy`` (where the workers run, ``cluster``, is `cluster_config.ClusterConfig`).
Static values live here; live objects (actors, tensors, loader factories) never do. Checks
that need only the config run in validators so a bad file fails before Ray starts;
`parse_section` turns pydantic's error into a `UserInputError` whose message names the
dotted key (``policy.optimizer.lr``), which the CLI maps to exit code 2. The one check that
needs the data-parallel size, `check_batch_layout`, runs when the worker group is built.
"""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.lora.config import LoraConfig

STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)  # every section's: `lr: .inf` is bad input


class ModelConfig(BaseModel):
    """The built-in decoder-only transformer (what ``policy.model_name: null`` trains; NeMo RL
    has no such model, so its sizes keep this runtime's names), and how a pretrained model's
    attention runs."""

    model_config = STRICT

    vocab_size: int = Field(256, ge=2)
    d_model: int = Field(64, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    max_seq_len: int = Field(128, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # a pretrained model: how attention runs. sdpa runs packed rows a sample at a time with no
    # mask (packed_attention.py); eager is for unpacked rows only (packing refuses it)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"

    @model_validator(mode="before")
    @classmethod
    def _nemo_rl_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and {"kind", "hf_path"} & data.keys():
            key = "hf_path" if "hf_path" in data else "kind"
            raise ValueError(
                f"policy.model.{key}: NeMo RL's name for the pretrained model is "
                "policy.model_name (a local model folder); policy.model holds the built-in "
                "transformer's sizes only"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"policy.model.d_model={self.d_model} must be divisible by "
                f"policy.model.n_heads={self.n_heads}"
            )
        return self


NEMO_RL_ADAMW: dict[str, Any] = {
    "lr": 5.0e-6,
    "weight_decay": 0.1,
    "betas": [0.9, 0.98],
    "eps": 1.0e-5,
    "foreach": False,
    "fused": False,
}
"""NeMo RL's ``policy.optimizer.kwargs`` in its base ``sft.yaml``."""

_RENAMED_OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay")
# schedulers that also cycle the momentum unless told not to (the schedule sets lr only)
_MOMENTUM_CYCLERS = ("OneCycleLR", "CyclicLR")


class OptimizerConfig(BaseModel):
    """NeMo RL's optimizer: any `torch.optim` class by dotted name, and its arguments.

    With the default class (AdamW) a kwarg left out gets NeMo RL's value (`NEMO_RL_ADAMW`);
    another class gets exactly the kwargs given, besides torch's own defaults.
    """

    model_config = STRICT

    name: str = "torch.optim.AdamW"
    kwargs: dict[str, Any] = Field(default_factory=lambda: dict(NEMO_RL_ADAMW))

    @model_validator(mode="before")
    @classmethod
    def _nemo_rl_shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key in _RENAMED_OPTIMIZER_KEYS:
            if key in data:
                raise ValueError(
                    f"policy.optimizer.{key}: NeMo RL's name is policy.optimizer.kwargs.{key} "
                    "(the optimizer is policy.optimizer.name with its kwargs)"
                )
        if data.get("name", "torch.optim.AdamW") == "torch.optim.AdamW":
            given = data.get("kwargs")
            if isinstance(given, dict):
                data = {**data, "kwargs": {**NEMO_RL_ADAMW, **given}}
        return data

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        _finite(self.kwargs, "policy.optimizer.kwargs")
        lr = self.kwargs.get("lr")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"policy.optimizer.kwargs.lr: must be a positive number, got {lr!r}")
        from sft_runtime.runtime.policy.schedule import check_optimizer

        check_optimizer(self.name, self.kwargs)
        return self

    @property
    def lr(self) -> float:
        """The base learning rate the schedule scales."""
        return float(self.kwargs["lr"])


def _finite(value: Any, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key}: Input should be a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _finite(v, f"{key}[{i}]")


SchedulerSpec = list[dict[str, Any]] | dict[str, Any] | None


def check_scheduler(spec: SchedulerSpec, base_lr: float) -> None:
    """NeMo RL's ``policy.scheduler``: one ``{name, kwargs}``, or a list of them with one
    ``{milestones: [...]}`` entry; ValueError naming the entry otherwise."""
    if spec is None:
        return
    entries = [spec] if isinstance(spec, dict) else spec
    if isinstance(spec, dict) and "kind" in spec:
        raise ValueError(
            "policy.scheduler.kind is not NeMo RL's shape: policy.scheduler is a list of "
            "{name: torch.optim.lr_scheduler.CLASS, kwargs: {...}} entries chained by one "
            "{milestones: [...]} entry (for example LinearLR for the warmup, then "
            "CosineAnnealingLR, with milestones: [WARMUP_STEPS])"
        )
    schedulers, milestones = 0, []
    for i, entry in enumerate(entries):
        where = "policy.scheduler" if isinstance(spec, dict) else f"policy.scheduler[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping, got {entry!r}")
        if "milestones" in entry:
            if isinstance(spec, dict) or set(entry) != {"milestones"}:
                raise ValueError(f"{where}: milestones stand alone in an entry of the list")
            milestones.append(entry["milestones"])
            continue
        unknown = sorted(set(entry) - {"name", "kwargs"})
        if "name" not in entry or unknown:
            raise ValueError(f"{where} takes name and kwargs, got {sorted(entry)}")
        kwargs = entry.get("kwargs") or {}
        _finite(kwargs, f"{where}.kwargs")
        if entry["name"].rpartition(".")[2] in _MOMENTUM_CYCLERS and kwargs.get(
            "cycle_momentum", True
        ):
            raise ValueError(
                f"{where}: the schedule sets the learning rate only; "
                "set kwargs.cycle_momentum: false"
            )
        schedulers += 1
    if len(milestones) > 1:
        raise ValueError("policy.scheduler: one milestones entry, not several")
    if schedulers > 1 and not milestones:
        raise ValueError(
            f"policy.scheduler chains {schedulers} schedulers: add a {{milestones: [...]}} "
            f"entry with {schedulers - 1} step(s)"
        )
    from sft_runtime.runtime.policy.schedule import check_schedule

    check_schedule(base_lr, spec)


class DTensorConfig(BaseModel):
    """NeMo RL's ``policy.dtensor_cfg``: FSDP2 over the data-parallel workers, and LoRA.

    ``enabled: true`` (NeMo RL's default) shards parameters, gradients and optimizer state with
    FSDP2 (each decoder layer and the root ``fully_shard``ed over the workers' mesh), so a
    model larger than one device fits; ``dp_replicate_size`` > 1 makes the mesh
    two-dimensional (replicate x shard, HSDP); ``enabled: false`` keeps a whole replica on
    every worker. ``param_dtype``/``reduce_dtype`` (ours) are
    FSDP2's `MixedPrecisionPolicy` (null: the parameters' own, float32). ``cpu_offload``
    is FSDP2's `CPUOffloadPolicy`: the shards of parameters, gradients and optimizer state
    stay in host memory, each layer's parameters are copied to the device for its forward
    and backward, and the optimizer step runs on the CPU. Tensor, sequence and context
    parallelism, a custom plan, ``env_vars`` and ``automodel_kwargs`` are accepted only at
    the value that turns nothing on.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    enabled: bool = True
    v2: bool = Field(True, alias="_v2")  # NeMo RL's worker version: one worker here
    activation_checkpointing: bool = False
    dp_replicate_size: int = Field(1, ge=1)
    reshard_after_forward: bool = True
    param_dtype: Literal["float32", "bfloat16"] | None = None
    reduce_dtype: Literal["float32", "bfloat16"] | None = None
    cpu_offload: bool = False
    sequence_parallel: bool = False
    tensor_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    custom_parallel_plan: str | None = None
    env_vars: dict[str, Any] = Field(default_factory=dict)
    automodel_kwargs: dict[str, Any] = Field(default_factory=dict)
    lora_cfg: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _check(self) -> DTensorConfig:
        off = {
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
            "sequence_parallel": False,
            "custom_parallel_plan": None,
            "env_vars": {},
            "automodel_kwargs": {},
        }
        for key, value in off.items():
            if getattr(self, key) != value:
                raise ValueError(
                    f"policy.dtensor_cfg.{key}={getattr(self, key)!r} is not supported here "
                    f"(data-parallel FSDP2 only); set it to {value!r}"
                )
        if not self.enabled:
            needs = [k for k in ("param_dtype", "reduce_dtype") if getattr(self, k) is not None]
            if self.dp_replicate_size != 1:
                needs.append("dp_replicate_size")
            if self.cpu_offload:  # offloads FSDP2's shards: a whole replica has none
                needs.append("cpu_offload")
            if needs:
                raise ValueError(
                    f"policy.dtensor_cfg.{needs[0]} is set but policy.dtensor_cfg.enabled is "
                    "false: set policy.dtensor_cfg.enabled=true or remove it"
                )
        return self


class MegatronConfig(BaseModel):
    """NeMo RL's ``policy.megatron_cfg``, accepted as its base config writes it (disabled):
    Megatron-Core is not a backend here."""

    model_config = ConfigDict(extra="allow")

    enabled: bool = False

    @model_validator(mode="after")
    def _check(self) -> MegatronConfig:
        if self.enabled:
            raise ValueError(
                "policy.megatron_cfg.enabled=true: Megatron-Core is not supported here; "
                "training runs on PyTorch FSDP2 (policy.dtensor_cfg)"
            )
        return self


class DynamicBatchingConfig(BaseModel):
    """NeMo RL's ``policy.dynamic_batching``: with ``enabled`` each rank's rows, sorted by
    length, go into micro-batches of at most ``train_mb_tokens`` padded tokens (rows x the
    longest row rounded up to ``sequence_length_round``) instead of
    ``train_micro_batch_size`` rows (`runtime.policy.dynamic_batches`). ``train_mb_tokens:
    null`` is NeMo RL's default, ``max_total_sequence_length`` x ``train_micro_batch_size``,
    written in by `MasterConfig`, whose rules need the other sections
    (`check_dynamic_batching`)."""

    model_config = STRICT

    enabled: bool = False
    train_mb_tokens: int | None = Field(None, ge=1)
    # accepted and inert: SFT has no logprob pass, and validation keeps
    # sft.val_micro_batch_size rows a micro-batch
    logprob_mb_tokens: int | None = Field(None, ge=1)
    sequence_length_round: int = Field(64, ge=1)


def _nemo_rl_policy_names(data: dict[str, Any]) -> dict[str, Any]:
    """Refuse this runtime's former names with NeMo RL's, and take ``automodel_cfg``
    (NeMo RL's newer name of ``dtensor_cfg``) merged over ``dtensor_cfg`` key by key, so a
    new recipe over an older base config reads as one block."""
    renamed = {
        "parallel": "policy.dtensor_cfg (enabled, dp_replicate_size, activation_checkpointing)",
        "lora": "policy.dtensor_cfg.lora_cfg",
    }
    for key, new in renamed.items():
        if key in data:
            raise ValueError(f"policy.{key}: NeMo RL's name is {new}")
    newer = data.get("automodel_cfg")
    if newer is None:
        return data
    data = {k: v for k, v in data.items() if k != "automodel_cfg"}
    older = data.get("dtensor_cfg") or {}
    if not isinstance(newer, dict) or not isinstance(older, dict):
        raise ValueError("policy.automodel_cfg must be a mapping (NeMo RL's dtensor_cfg)")
    merged = {**older, **newer}
    if isinstance(older.get("lora_cfg"), dict) and isinstance(newer.get("lora_cfg"), dict):
        merged["lora_cfg"] = {**older["lora_cfg"], **newer["lora_cfg"]}
    return {**data, "dtensor_cfg": merged}


class PolicyConfig(BaseModel):
    """Everything a policy worker needs to build and train its replica."""

    model_config = STRICT

    # NeMo RL's: a local Hugging Face model folder; null trains the built-in `model`
    model_name: str | None = None
    model: ModelConfig = ModelConfig()
    tokenizer: dict | None = None
    train_global_batch_size: int = Field(32, ge=1)  # conversations a step
    train_micro_batch_size: int = Field(1, ge=1)
    # NeMo RL's: the longest row the policy trains on (null: data.max_input_seq_length)
    max_total_sequence_length: int | None = Field(None, ge=2)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    # NeMo RL's: None is a constant rate (see schedule.py)
    scheduler: SchedulerSpec = None
    make_sequence_length_divisible_by: int = Field(1, ge=1)
    precision: Literal["float32", "bfloat16"] = "bfloat16"
    # FSDP2 and the adapters on a frozen base (runtime.lora; the base is stored in `precision`)
    dtensor_cfg: DTensorConfig = DTensorConfig()
    megatron_cfg: MegatronConfig = MegatronConfig()
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    offload_optimizer_for_logprob: Literal[False] = False  # no logprob pass in SFT

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        return _nemo_rl_policy_names(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> PolicyConfig:
        if self.dtensor_cfg.lora_cfg.enabled and not self.is_hf:
            raise ValueError(
                "policy.dtensor_cfg.lora_cfg.enabled=true needs a pretrained Hugging Face "
                "model (policy.model_name): adapters fine-tune a frozen base, and the built-in "
                "transformer has none"
            )
        if self.train_global_batch_size % self.train_micro_batch_size != 0:
            raise ValueError(
                f"policy.train_global_batch_size={self.train_global_batch_size} must be a "
                f"multiple of policy.train_micro_batch_size={self.train_micro_batch_size}"
            )
        check_scheduler(self.scheduler, self.optimizer.lr)
        return self

    @property
    def is_hf(self) -> bool:
        """A pretrained Hugging Face model (``model_name``), not the built-in transformer."""
        return self.model_name is not None


def check_batch_layout(policy: PolicyConfig, dp_size: int) -> int:
    """Rows each DP rank trains on per step; raises if the global batch does not split evenly."""
    per_rank, rest = divmod(policy.train_global_batch_size, dp_size)
    if rest or per_rank % policy.train_micro_batch_size:
        raise UserInputError(
            f"policy.train_global_batch_size={policy.train_global_batch_size} must be a "
            f"multiple of data-parallel size {dp_size} x "
            f"policy.train_micro_batch_size={policy.train_micro_batch_size}"
        )
    replicate = policy.dtensor_cfg.dp_replicate_size
    if replicate > 1 and dp_size % replicate:
        raise UserInputError(
            f"policy.dtensor_cfg.dp_replicate_size={replicate} must divide the "
            f"data-parallel size {dp_size}"
        )
    return per_rank


def check_dynamic_batching(policy: PolicyConfig, longest: int, *, packing: bool) -> int | None:
    """The token budget of a dynamic micro-batch, None when dynamic batching is off.

    ``longest`` is the longest row (``data.max_input_seq_length``). A null budget is NeMo
    RL's default, ``policy.max_total_sequence_length`` (null: ``longest``) x
    ``train_micro_batch_size``. ValueError naming the key when sequence packing is on too
    (NeMo RL runs one or the other), or when the budget is smaller than the longest row
    rounded up to ``sequence_length_round``.
    """
    dynamic = policy.dynamic_batching
    if not dynamic.enabled:
        return None
    if packing:
        raise ValueError(
            "policy.dynamic_batching.enabled=true together with "
            "policy.sequence_packing.enabled=true: NeMo RL runs one or the other; turn one off"
        )
    default = (policy.max_total_sequence_length or longest) * policy.train_micro_batch_size
    budget = dynamic.train_mb_tokens or default
    rounding = dynamic.sequence_length_round
    row = -(-longest // rounding) * rounding
    if budget < row:
        shown = (
            f"={budget}"
            if dynamic.train_mb_tokens
            else " (null: policy.max_total_sequence_length x "
            f"policy.train_micro_batch_size = {budget})"
        )
        raise ValueError(
            f"policy.dynamic_batching.train_mb_tokens{shown} is smaller than the longest row, "
            f"{longest} tokens rounded up to policy.dynamic_batching.sequence_length_round="
            f"{rounding} ({row}): set it to at least {row}"
        )
    return budget


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
        # a check that names the key itself (a deeper one) is not prefixed twice
        lines.append(msg if msg.startswith(key) else f"{key}: {msg}")
    return UserInputError("invalid config:\n  " + "\n  ".join(lines))

"""Every key of NeMo RL's base SFT config, and what this runtime does with it.

The table below names each leaf key of ``tests/support/nemo_rl/sft.yaml`` (NeMo RL's
``examples/configs/sft.yaml``, key for key) as one of:

- honoured: taken with NeMo RL's meaning. The test sets another value and reads it back where
  the runtime uses it (what the value then does to a run is tested where that feature is).
- inert: accepted at NeMo RL's value, which turns nothing on here; where the key is a switch,
  the value that would ask for the feature is refused with one line naming the key. A key
  that switches nothing (a name, an interval of a backend that is off) has no such value.
- refused: NeMo RL's value is refused with one line naming the key, never ignored.

A key added to the YAML file without a row here fails `test_the_table_covers_every_key`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sft_runtime.runtime.config import MasterConfig, validate_config
from sft_runtime.runtime.config_files.loader import read_config
from sft_runtime.runtime.config_files.overrides import apply_override
from sft_runtime.runtime.errors import UserInputError

SFT_YAML = Path(__file__).resolve().parents[2] / "support" / "nemo_rl" / "sft.yaml"

# What a user on a machine with no GPU and no hub gives besides the file (the done criterion).
BASE_OVERRIDES = (
    "policy.model_name=/models/tiny",
    "cluster.gpus_per_node=0",
    "data.train.dataset_name=openai_format",
    "+data.train.data_path=/data/train.jsonl",
    "data.validation.dataset_name=openai_format",
    "+data.validation.data_path=/data/val.jsonl",
    "logger.wandb_enabled=false",  # the backends get their own tests
    "logger.tensorboard_enabled=false",
)

Get = Callable[[MasterConfig], Any]


def honoured(value: Any, get: Get) -> tuple[str, Any, Get]:
    return ("honoured", value, get)


def inert(asks_for: Any = None) -> tuple[str, Any, None]:
    return ("inert", asks_for, None)


def refused(value: Any) -> tuple[str, Any, None]:
    return ("refused", value, None)


def _lora(key: str, value: Any) -> tuple[str, Any, Get]:
    return honoured(value, lambda c: getattr(c.policy.dtensor_cfg.lora_cfg, key))


MEGATRON_KEYS = [
    "env_vars",
    "empty_unused_memory_level",
    "activation_checkpointing",
    "tensor_model_parallel_size",
    "expert_tensor_parallel_size",
    "expert_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "pipeline_dtype",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "sequence_parallel",
    "freeze_moe_router",
    "moe_router_dtype",
    "moe_router_load_balancing_type",
    "moe_router_bias_update_rate",
    "moe_permute_fusion",
    "apply_rope_fusion",
    "bias_activation_fusion",
    "defer_fp32_logits",
    "moe_per_layer_logging",
    "moe_enable_deepep",
    "moe_token_dispatcher_type",
    "moe_shared_expert_overlap",
    *(
        f"peft.{k}"
        for k in (
            "enabled target_modules exclude_modules dim alpha dropout dropout_position "
            "lora_A_init_method lora_B_init_method a2a_experimental lora_dtype"
        ).split()
    ),
    *(
        f"optimizer.{k}"
        for k in (
            "optimizer lr min_lr weight_decay bf16 fp16 params_dtype adam_beta1 adam_beta2 "
            "adam_eps sgd_momentum use_distributed_optimizer use_precision_aware_optimizer "
            "clip_grad optimizer_cpu_offload optimizer_offload_fraction"
        ).split()
    ),
    *(
        f"scheduler.{k}"
        for k in (
            "start_weight_decay end_weight_decay weight_decay_incr_style lr_decay_style "
            "lr_decay_iters lr_warmup_iters lr_warmup_init"
        ).split()
    ),
    *(
        f"distributed_data_parallel_config.{k}"
        for k in (
            "grad_reduce_in_fp32 overlap_grad_reduce overlap_param_gather "
            "data_parallel_sharding_strategy use_custom_fsdp"
        ).split()
    ),
    *(f"fp8_cfg.{k}" for k in ("enabled", "fp8", "fp8_recipe", "fp8_param")),
]

TABLE: dict[str, tuple[str, Any, Get | None]] = {
    "sft.max_num_epochs": honoured(3, lambda c: c.sft.max_num_epochs),
    "sft.max_num_steps": honoured(7, lambda c: c.sft.max_num_steps),
    "sft.val_period": honoured(5, lambda c: c.sft.val_period),
    "sft.val_batches": honoured(2, lambda c: c.sft.val_batches),
    "sft.val_global_batch_size": honoured(16, lambda c: c.sft.val_global_batch_size),
    "sft.val_micro_batch_size": honoured(2, lambda c: c.sft.val_micro_batch_size),
    "sft.val_at_start": honoured(False, lambda c: c.sft.val_at_start),
    "sft.val_at_end": honoured(True, lambda c: c.sft.val_at_end),
    "sft.seed": honoured(7, lambda c: c.sft.seed),
    "checkpointing.enabled": honoured(False, lambda c: c.checkpointing.enabled),
    "checkpointing.checkpoint_dir": honoured("ckpt", lambda c: c.checkpointing.checkpoint_dir),
    "checkpointing.metric_name": honoured("train:loss", lambda c: c.checkpointing.metric_name),
    "checkpointing.higher_is_better": honoured(True, lambda c: c.checkpointing.higher_is_better),
    "checkpointing.keep_top_k": honoured(1, lambda c: c.checkpointing.keep_top_k),
    "checkpointing.save_period": honoured(4, lambda c: c.checkpointing.save_period),
    "checkpointing.checkpoint_must_save_by": honoured(
        "00:01:00:00", lambda c: c.checkpointing.checkpoint_must_save_by
    ),
    "policy.model_name": honoured("/models/other", lambda c: c.policy.model_name),
    "policy.tokenizer.name": honoured("/tokenizers/other", lambda c: c.policy.tokenizer.path),
    "policy.tokenizer.chat_template": honoured(
        "{{ 'x' }}", lambda c: c.policy.tokenizer.chat_template
    ),
    "policy.tokenizer.chat_template_kwargs": honoured(
        {"enable_thinking": False}, lambda c: c.policy.tokenizer.chat_template_kwargs
    ),
    "policy.train_global_batch_size": honoured(64, lambda c: c.policy.train_global_batch_size),
    "policy.train_micro_batch_size": honoured(2, lambda c: c.policy.train_micro_batch_size),
    # data.max_input_seq_length follows it (NeMo RL's interpolation)
    "policy.max_total_sequence_length": honoured(512, lambda c: c.data.max_input_seq_length),
    "policy.precision": honoured("float32", lambda c: c.policy.precision),
    "policy.offload_optimizer_for_logprob": inert(True),
    "policy.dtensor_cfg._v2": inert(),
    "policy.dtensor_cfg.enabled": honoured(False, lambda c: c.policy.dtensor_cfg.enabled),
    "policy.dtensor_cfg.env_vars": inert({"NCCL_DEBUG": "INFO"}),
    "policy.dtensor_cfg.cpu_offload": honoured(True, lambda c: c.policy.dtensor_cfg.cpu_offload),
    "policy.dtensor_cfg.sequence_parallel": inert(True),
    "policy.dtensor_cfg.activation_checkpointing": honoured(
        True, lambda c: c.policy.dtensor_cfg.activation_checkpointing
    ),
    "policy.dtensor_cfg.tensor_parallel_size": inert(2),
    "policy.dtensor_cfg.context_parallel_size": inert(2),
    "policy.dtensor_cfg.custom_parallel_plan": inert("my.plan"),
    "policy.dtensor_cfg.automodel_kwargs": inert({"force_hf": True}),
    "policy.dtensor_cfg.lora_cfg.enabled": _lora("enabled", True),
    "policy.dtensor_cfg.lora_cfg.target_modules": None,  # set below with match_all_linear
    "policy.dtensor_cfg.lora_cfg.exclude_modules": _lora("exclude_modules", ["lm_head"]),
    "policy.dtensor_cfg.lora_cfg.match_all_linear": None,  # set below with target_modules
    "policy.dtensor_cfg.lora_cfg.dim": _lora("dim", 16),
    "policy.dtensor_cfg.lora_cfg.alpha": _lora("alpha", 16),
    "policy.dtensor_cfg.lora_cfg.dropout": None,  # set below with dropout_position
    "policy.dtensor_cfg.lora_cfg.dropout_position": _lora("dropout_position", "pre"),
    "policy.dtensor_cfg.lora_cfg.lora_A_init": _lora("lora_A_init", "uniform"),
    "policy.dtensor_cfg.lora_cfg.use_triton": inert(),  # peft's kernels run either way
    # the replica splits each rank's rows by this budget (runtime/policy/dynamic_batches.py)
    "policy.dynamic_batching.enabled": honoured(True, lambda c: c.policy.dynamic_batching.enabled),
    "policy.dynamic_batching.train_mb_tokens": honoured(
        4096, lambda c: c.policy.dynamic_batching.train_mb_tokens
    ),
    "policy.dynamic_batching.sequence_length_round": honoured(
        32, lambda c: c.policy.dynamic_batching.sequence_length_round
    ),
    "policy.sequence_packing.enabled": honoured(True, lambda c: c.policy.sequence_packing.enabled),
    # taken at NeMo RL's value only (see test_packing_takes_nemo_rls_token_budget_only)
    "policy.sequence_packing.train_mb_tokens": inert(),
    "policy.sequence_packing.algorithm": honoured(
        "first_fit_decreasing", lambda c: c.policy.sequence_packing.algorithm
    ),
    "policy.sequence_packing.sequence_length_round": inert(),  # padding changes no loss here
    "policy.make_sequence_length_divisible_by": honoured(
        8, lambda c: c.policy.make_sequence_length_divisible_by
    ),
    "policy.max_grad_norm": honoured(0.5, lambda c: c.policy.max_grad_norm),
    "policy.optimizer.name": honoured("torch.optim.Adam", lambda c: c.policy.optimizer.name),
    **{
        f"policy.optimizer.kwargs.{k}": honoured(v, lambda c, k=k: c.policy.optimizer.kwargs[k])
        for k, v in {
            "lr": 1e-4,
            "weight_decay": 0.0,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "foreach": True,
            "fused": None,
        }.items()
    },
    "policy.megatron_cfg.enabled": inert(True),
    **{f"policy.megatron_cfg.{k}": inert() for k in MEGATRON_KEYS if k != "enabled"},
    "data.max_input_seq_length": honoured(256, lambda c: c.data.max_input_seq_length),
    "data.add_bos": honoured(False, lambda c: c.data.add_bos),
    "data.add_eos": honoured(False, lambda c: c.data.add_eos),
    "data.add_generation_prompt": honoured(True, lambda c: c.data.add_generation_prompt),
    "data.shuffle": honoured(False, lambda c: c.data.shuffle),
    "data.num_workers": honoured(0, lambda c: c.data.num_workers),
    "data.train.dataset_name": refused("squad"),  # no hub here: bring a local file
    "data.train.split": inert(),  # a local file is one split
    "data.validation.dataset_name": refused("squad"),
    "data.validation.split": inert(),
    "data.default.prompt_file": inert(),
    "data.default.system_prompt_file": inert(),
    "data.default.processor": inert("my_processor"),
    "logger.log_dir": honoured("elsewhere", lambda c: c.logger.log_dir),
    "logger.wandb_enabled": honoured(False, lambda c: c.logger.wandb_enabled),
    "logger.tensorboard_enabled": honoured(False, lambda c: c.logger.tensorboard_enabled),
    "logger.mlflow_enabled": honoured(False, lambda c: c.logger.mlflow_enabled),
    "logger.swanlab_enabled": inert(True),
    "logger.monitor_gpus": honoured(False, lambda c: c.logger.monitor_gpus),
    "logger.wandb.project": honoured("p", lambda c: c.logger.wandb.project),
    "logger.wandb.name": honoured("n", lambda c: c.logger.wandb.name),
    "logger.swanlab.project": inert(),
    "logger.swanlab.name": inert(),
    "logger.tensorboard.log_dir": honoured("tb", lambda c: c.logger.tensorboard.log_dir),
    "logger.mlflow.experiment_name": honoured("e", lambda c: c.logger.mlflow.experiment_name),
    "logger.mlflow.run_name": honoured("r", lambda c: c.logger.mlflow.run_name),
    "logger.gpu_monitoring.collection_interval": honoured(
        5, lambda c: c.logger.gpu_monitoring.collection_interval
    ),
    "logger.gpu_monitoring.flush_interval": honoured(
        5, lambda c: c.logger.gpu_monitoring.flush_interval
    ),
    "cluster.gpus_per_node": honoured(0, lambda c: c.cluster.gpus_per_node),
    "cluster.num_nodes": honoured(1, lambda c: c.cluster.num_nodes),
}

# keys honoured only together with another (a rule ties them)
TOGETHER: dict[str, tuple[tuple[str, ...], Get, Any]] = {
    "policy.dtensor_cfg.lora_cfg.target_modules": (
        (
            "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj]",
            "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
        ),
        lambda c: c.policy.dtensor_cfg.lora_cfg.target_modules,
        ["q_proj"],
    ),
    "policy.dtensor_cfg.lora_cfg.match_all_linear": (
        (
            "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
            "policy.dtensor_cfg.lora_cfg.exclude_modules=[lm_head]",
        ),
        lambda c: c.policy.dtensor_cfg.lora_cfg.match_all_linear,
        False,
    ),
    "policy.dtensor_cfg.lora_cfg.dropout": (
        (
            "policy.dtensor_cfg.lora_cfg.dropout=0.1",
            "policy.dtensor_cfg.lora_cfg.dropout_position=pre",
        ),
        lambda c: c.policy.dtensor_cfg.lora_cfg.dropout,
        0.1,
    ),
}


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [k for key, v in node.items() for k in _leaves(v, f"{prefix}{key}.")]
    return [prefix[:-1]]


def _load(*overrides: str) -> MasterConfig:
    return validate_config(read_config(SFT_YAML, [*BASE_OVERRIDES, *overrides]), source="sft")


def _raw_with(key: str, value: Any) -> dict[str, Any]:
    """The file with one key set as a user sets it: an override, before the file's
    interpolations are resolved (so what follows the key follows the new value)."""
    return read_config(SFT_YAML, [*BASE_OVERRIDES, f"{key}={json.dumps(value)}"])


def test_the_table_covers_every_key():
    import yaml

    keys = _leaves(yaml.safe_load(SFT_YAML.read_text()))
    assert sorted(keys) == sorted(TABLE), set(keys) ^ set(TABLE)


def test_the_file_loads_unedited_but_for_model_data_and_gpus():
    config = _load()
    assert config.policy.model_name == "/models/tiny" and config.policy.dtensor_cfg.enabled
    assert config.policy.tokenizer.path == "/models/tiny"  # ${policy.model_name}
    assert config.data.max_input_seq_length == 1024  # ${policy.max_total_sequence_length}
    assert config.policy.optimizer.kwargs["lr"] == 5e-6 and config.policy.precision == "bfloat16"


@pytest.mark.parametrize("key", [k for k, row in TABLE.items() if row and row[0] == "honoured"])
def test_an_honoured_key_takes_a_new_value(key):
    _, value, get = TABLE[key]
    assert get is not None
    config = validate_config(_raw_with(key, value), source="sft")
    assert get(config) == value


@pytest.mark.parametrize("key", sorted(TOGETHER))
def test_keys_honoured_together(key):
    overrides, get, value = TOGETHER[key]
    raw = read_config(SFT_YAML, list(BASE_OVERRIDES))
    for item in overrides:
        apply_override(raw, item)
    assert get(validate_config(raw, source="sft")) == value


@pytest.mark.parametrize(
    "key",
    [
        k
        for k, row in TABLE.items()
        if row and row[0] in ("inert", "refused") and row[1] is not None
    ],
)
def test_a_value_that_asks_for_what_is_not_here_is_refused_naming_the_key(key):
    with pytest.raises(UserInputError) as err:
        validate_config(_raw_with(key, TABLE[key][1]), source="sft")
    problems = str(err.value).splitlines()[1:]
    assert len(problems) == 1, problems
    assert key.rsplit(".", 1)[0] in problems[0] and key.rsplit(".", 1)[1] in problems[0]


def test_packing_takes_nemo_rls_token_budget_only():
    """NeMo RL packs a micro-batch up to ``train_mb_tokens`` tokens; here a packed micro-batch
    is ``train_micro_batch_size`` rows of at most the longest sequence, which is NeMo RL's
    default budget (its interpolation): that value is taken, another refused in one line."""
    packed = _load("policy.sequence_packing.enabled=true", "policy.train_micro_batch_size=2")
    assert packed.policy.sequence_packing.train_mb_tokens == 2048  # followed the micro-batch
    with pytest.raises(UserInputError) as err:
        _load(
            "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=4096"
        )
    problems = str(err.value).splitlines()[1:]
    assert len(problems) == 1 and "policy.sequence_packing.train_mb_tokens=4096" in problems[0]


def test_dynamic_batching_takes_nemo_rls_default_budget():
    """NeMo RL's file writes ``train_mb_tokens`` as the longest row x the micro-batch (its
    interpolation), and null means the same; ``logprob_mb_tokens`` (not in its SFT file) is
    accepted and changes nothing here (no logprob pass in SFT)."""
    on = ("policy.dynamic_batching.enabled=true", "policy.train_micro_batch_size=2")
    followed = _load(*on)
    assert followed.policy.dynamic_batching.train_mb_tokens == 2048
    null = _load(*on, "policy.dynamic_batching.train_mb_tokens=null")
    assert null.policy.dynamic_batching.train_mb_tokens == 2048
    accepted = _load(*on, "+policy.dynamic_batching.logprob_mb_tokens=512").policy
    assert accepted.dynamic_batching.logprob_mb_tokens == 512
    rest = {"dynamic_batching": {"logprob_mb_tokens"}}
    assert accepted.model_dump(exclude=rest) == followed.policy.model_dump(exclude=rest)

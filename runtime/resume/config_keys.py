"""Which config keys decide what a training step computes: the one table a resume is judged by.

A resume is bit-exact only when every key that shapes a step's numbers has the value the
checkpoint was trained with. Each leaf key of `MasterConfig` is one of:

- ``shape``: the checkpoint's weights (or adapters) only fit a model of these values; a
  change can never resume, whatever the user allows (``dtensor_cfg.enabled`` decides the weights'
  layout on disk, so it is one too).
- ``compute``: a change trains on, but no longer as the checkpoint's run would have: the
  batch layout, sequence handling, data order, precision, seed, threads, validation.
- ``optimizer``: the optimizer's and schedule's hyper-parameters and the clipping norm; a
  ``compute`` key, except that after a step diverged (a non-finite loss) the same command
  with a smaller learning rate resumes without ``--allow-config-change``.
- ``placement``: how many data-parallel workers train the run, and the data shards they
  split (``data.elastic.shards``, fixed at the run's start): the workers may change to any
  number that divides the shards, the shards never (runtime/resume/placement_change.py).
  The same samples train each step; only the gradient sums' order changes.
- ``free``: when a run stops, saves and logs, where it runs and how long it waits; and keys
  that cannot reach a step on resume (``lora.lora_A_init`` only seeds fresh adapters,
  ``data.skip_bad_samples`` and ``sft.skip_nonfinite_steps`` only change a step that would
  otherwise have stopped the run, read-ahead loads the same batches).

Paths are compared by what they hold (`IDENTITY_KEYS`): a byte-identical data set or model
folder moved elsewhere is the same input. A key missing from `KEY_KINDS` fails the unit test
that walks `MasterConfig`, so a new key cannot be forgotten.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

Kind = Literal["shape", "compute", "optimizer", "placement", "free"]
SHAPE: Kind = "shape"
COMPUTE: Kind = "compute"
OPTIMIZER: Kind = "optimizer"
PLACEMENT: Kind = "placement"
FREE: Kind = "free"


def _all(kind: Kind, *keys: str) -> dict[str, Kind]:
    return dict.fromkeys(keys, kind)


KEY_KINDS: dict[str, Kind] = {
    **_all(
        SHAPE,
        "policy.model.vocab_size",
        "policy.model.d_model",
        "policy.model.n_layers",
        "policy.model.n_heads",
        "policy.model.max_seq_len",
        "policy.model_name",  # by its config.json: the architecture the weights fit
        "policy.dtensor_cfg.enabled",
        "policy.dtensor_cfg.lora_cfg.enabled",
        "policy.dtensor_cfg.lora_cfg.target_modules",
        "policy.dtensor_cfg.lora_cfg.exclude_modules",
        "policy.dtensor_cfg.lora_cfg.match_all_linear",
        "policy.dtensor_cfg.lora_cfg.dim",
    ),
    **_all(
        COMPUTE,
        "policy.model.dropout",
        "policy.model.attn_implementation",
        "policy.tokenizer.name",  # by its files: the token ids and the chat template
        "policy.tokenizer.chat_template",
        "policy.tokenizer.chat_template_kwargs",
        "policy.train_global_batch_size",
        "policy.train_micro_batch_size",
        # the micro-batch split, hence the loss's float rounding
        "policy.dynamic_batching.enabled",
        "policy.dynamic_batching.train_mb_tokens",
        "policy.dynamic_batching.sequence_length_round",
        "policy.make_sequence_length_divisible_by",
        "policy.precision",
        "policy.dtensor_cfg.param_dtype",
        "policy.dtensor_cfg.reduce_dtype",
        "policy.dtensor_cfg.activation_checkpointing",
        "policy.dtensor_cfg.cpu_offload",  # on a GPU the optimizer steps in CPU code
        "policy.dtensor_cfg.dp_replicate_size",
        "policy.dtensor_cfg.lora_cfg.alpha",
        "policy.dtensor_cfg.lora_cfg.dropout",
        "policy.dtensor_cfg.lora_cfg.dropout_position",
        "policy.sequence_packing.enabled",
        "policy.sequence_packing.algorithm",
        "policy.sequence_packing.max_sequences_per_bin",
        "policy.sequence_packing.balanced_knapsack_delta",
        "data.backend",
        "data.max_input_seq_length",
        "data.train.path",  # by the data set's content
        "data.train.split",
        "data.train.virtual_epoch_length",
        "data.num_workers",
        "data.shuffle",
        "data.energon.shuffle_buffer_size",
        "data.energon.topology_mapper",
        "data.validation.path",  # by the data set's content
        "data.validation.split",
        "data.overlong_samples",
        "data.add_bos",
        "data.add_eos",
        "data.add_generation_prompt",
        "data.train.prompt_file",  # its text is in the loader fingerprint too
        "data.validation.prompt_file",
        "sft.seed",
        "sft.val_period",
        "sft.val_at_end",
        "sft.val_batches",
        "sft.val_global_batch_size",
        "sft.val_micro_batch_size",
        "sft.only_unmask_final",
        "cluster.gpus_per_node",
        "cluster.num_threads_per_worker",
    ),
    **_all(PLACEMENT, "cluster.num_nodes", "cluster.workers_per_node", "data.elastic.shards"),
    **_all(
        OPTIMIZER,
        "policy.max_grad_norm",
        "policy.optimizer.name",
        "policy.optimizer.kwargs",  # compared key by key (policy.optimizer.kwargs.lr)
        "policy.scheduler",
    ),
    **_all(
        FREE,
        "policy.dtensor_cfg.reshard_after_forward",
        "policy.dtensor_cfg.lora_cfg.lora_A_init",
        "policy.dtensor_cfg.lora_cfg.use_triton",
        # NeMo RL's keys taken at the one value that turns nothing on (policy/config.py)
        *(
            f"policy.dtensor_cfg.{key}"
            for key in (
                "v2",
                "sequence_parallel",
                "tensor_parallel_size",
                "context_parallel_size",
                "custom_parallel_plan",
                "env_vars",
                "automodel_kwargs",
            )
        ),
        "policy.megatron_cfg.enabled",
        "policy.dynamic_batching.logprob_mb_tokens",  # no logprob pass in SFT
        "policy.offload_optimizer_for_logprob",
        # a bound and a default of data.max_input_seq_length, which is compared itself
        "policy.max_total_sequence_length",
        "policy.sequence_packing.train_mb_tokens",  # only its one value is taken
        "policy.sequence_packing.sequence_length_round",  # pads no row here
        "data.skip_bad_samples",
        # a data file is judged by the data set prepared from it (data.*.path, by content)
        *(
            f"data.{section}.{key}"
            for section in ("train", "validation")
            for key in (
                "dataset_name",
                "data_path",
                "chat_key",
                "system_key",
                "system_prompt",
                "tool_key",
                "input_key",
                "output_key",
            )
        ),
        "data.train.split_validation_size",
        "data.train.seed",
        # each has one accepted value (sft_processor, null): nothing to change
        *(
            f"data.{section}.{key}"
            for section in ("train", "validation")
            for key in ("processor", "system_prompt_file")
        ),
        "sft.max_num_steps",
        "sft.max_num_epochs",
        "sft.val_at_start",
        "sft.skip_nonfinite_steps",
        "data_plane.impl",
        "data_plane.max_partitions",
        "data_plane.load_during_allreduce",
        "logger.log_dir",
        "logger.jsonl",
        "logger.tensorboard_enabled",
        "logger.tensorboard.log_dir",
        "logger.wandb_enabled",
        "logger.mlflow_enabled",
        "logger.swanlab_enabled",
        "logger.monitor_gpus",
        *(f"logger.wandb.{k}" for k in ("project", "name", "entity", "group", "tags")),
        *(f"logger.mlflow.{k}" for k in ("experiment_name", "run_name", "tracking_uri")),
        "logger.swanlab.project",
        "logger.swanlab.name",
        "logger.gpu_monitoring.collection_interval",
        "logger.gpu_monitoring.flush_interval",
        "cluster.address",
        "cluster.cpus_per_worker",
        "cluster.placement_strategy",
        "cluster.dist_timeout_s",
        "cluster.call_timeout_s",
        "cluster.placement_timeout_s",
        "cluster.connect_timeout_s",
        "cluster.worker_niceness",
        "checkpointing.enabled",
        "checkpointing.checkpoint_dir",
        "checkpointing.save_period",
        "checkpointing.ft_save_period",
        "checkpointing.metric_name",
        "checkpointing.higher_is_better",
        "checkpointing.keep_top_k",
        "checkpointing.ft_keep_latest_k",
        "checkpointing.checkpoint_must_save_by",
        "checkpointing.save_optimizer",
        "checkpointing.background_writes",
        "checkpointing.allow_config_change",
        "telemetry.enabled",
        "telemetry.service_name",
        "telemetry.exporters",
        "telemetry.otlp_endpoint",
        "telemetry.otlp_protocol",
        "telemetry.otlp_traces",
        "telemetry.otlp_metrics",
        "telemetry.otlp_traces_endpoint",
        "telemetry.otlp_metrics_endpoint",
        "telemetry.export_timeout_s",
        "telemetry.shutdown_timeout_s",
        "telemetry.jaeger_file_max_spans",
    ),
}

IDENTITY_KEYS: dict[str, str] = {
    "data.train.path": "data set",
    "data.validation.path": "data set",
    "policy.model_name": "model config",
    "policy.tokenizer.name": "tokenizer",
}
"""Keys naming a path whose content, not its spelling, is the input (see input_identity.py)."""


def computation_keys() -> list[str]:
    """Every key whose change changes a step (shape, compute and optimizer keys)."""
    return [key for key, kind in KEY_KINDS.items() if kind != FREE]


def config_leaves(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """The dotted leaf keys of a config model (default `MasterConfig`): a field whose type is
    a section (optionally None) is walked into, any other field is a leaf."""
    from sft_runtime.runtime.config import MasterConfig, _model_of

    out = []
    for name, field in (model or MasterConfig).model_fields.items():
        section = _model_of(field.annotation)
        key = f"{prefix}{name}"
        out.extend([key] if section is None else config_leaves(section, f"{key}."))
    return out


def flatten(config: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """``{dotted key: value}`` of a config dumped as plain data (None under a null section;
    `MISSING` where a section holds no such key, as in a config of an older release)."""
    out = {}
    for key in keys:
        node: Any = config
        for part in key.split("."):
            if node is None:
                break
            node = node.get(part, MISSING) if isinstance(node, dict) else MISSING
        out[key] = node
    return out


MISSING = "<absent>"

# What a run computed before each of these keys existed, where NeMo RL's default (today's)
# differs: a checkpoint whose config.yaml lacks the key resumes as it was written.
BEFORE_THE_KEY: dict[str, Any] = {
    "data.add_bos": False,
    "data.add_generation_prompt": True,
    "data.num_workers": 0,
}

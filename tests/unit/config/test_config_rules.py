"""Every config rule fails before Ray starts, naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.demo import demo_config
from sft_runtime.runtime.config import _max_train_steps, load_config, validate_config
from sft_runtime.runtime.config_files.overrides import apply_override
from sft_runtime.runtime.errors import UserInputError
from tests.support.small_run import small_raw

ROOT = Path(__file__).resolve().parents[3]


def _raw(**overrides):
    raw = small_raw(Path("/tmp/run"), Path("/tmp/data"))
    for key, value in overrides.items():
        apply_override(raw, f"{key}={value}")
    return raw


def test_max_train_steps_is_the_smaller_budget():
    config = validate_config(
        _raw(
            **{
                "sft.max_num_steps": 100,
                "sft.max_num_epochs": 3,
                "data.train.virtual_epoch_length": 7,
            }
        )
    )
    assert _max_train_steps(config) == 21
    config = validate_config(_raw(**{"sft.max_num_steps": 5}))
    assert _max_train_steps(config) == 5


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("data.backend", "webdataset", "data.backend"),
        ("data.max_input_seq_length", "null", "data.max_input_seq_length"),
        ("data.train.virtual_epoch_length", "0", "data.train.virtual_epoch_length"),
        ("sft.val_period", "5", "sft.val_period is set but data.validation is null"),
        ("sft.val_at_start", "true", "sft.val_at_start is set but data.validation is null"),
        ("sft.val_at_end", "true", "sft.val_at_end is set but data.validation is null"),
        ("sft.val_period", "-1", "sft.val_period"),
        ("checkpointing.metric_name", "loss", "'train:<metric>'"),
        ("checkpointing.metric_name", "val:loss", "'val:loss' is not a validation metric"),
        ("checkpointing.metric_name", "val:val_loss", "no validation runs in this config"),
        ("+data.energon.packing_buffer_size", "16", "there is no packing buffer"),
        ("policy.sequence_packing.algorithm", "best_fit", "policy.sequence_packing.algorithm"),
        ("checkpointing.checkpoint_must_save_by", "3h", "DD:HH:MM:SS"),
        ("checkpointing.checkpoint_must_save_by", "00:25:00:00", "hours < 24"),
        ("policy.model.max_seq_len", "32", "policy.model.max_seq_len"),
        ("sft.max_num_steps", "0", "sft.max_num_steps"),
        ("cluster.num_nodes", "2", "checkpointing.checkpoint_dir"),
        ("policy.dtensor_cfg.param_dtype", "bfloat16", "policy.dtensor_cfg.enabled is false"),
        ("policy.dtensor_cfg.dp_replicate_size", "2", "policy.dtensor_cfg.dp_replicate_size"),
        ("policy.dtensor_cfg.reduce_dtype", "float16", "policy.dtensor_cfg.reduce_dtype"),
    ],
)
def test_each_rule_names_its_key(key, value, expected):
    with pytest.raises(UserInputError) as err:
        validate_config(_raw(**{key: value}))
    assert expected in str(err.value)


def test_the_replicate_dimension_must_divide_the_data_parallel_size():
    ok = validate_config(
        _raw(**{"policy.dtensor_cfg.enabled": "true", "policy.dtensor_cfg.dp_replicate_size": "2"})
    )
    assert ok.policy.dtensor_cfg.dp_replicate_size == 2
    with pytest.raises(UserInputError, match="policy.dtensor_cfg.dp_replicate_size=3 must divide"):
        validate_config(
            _raw(
                **{
                    "policy.dtensor_cfg.enabled": "true",
                    "policy.dtensor_cfg.dp_replicate_size": "3",
                }
            )
        )


def test_cpu_offload_is_taken_with_fsdp_and_refused_without_naming_the_key():
    """``policy.dtensor_cfg.cpu_offload`` offloads FSDP2's shards: a whole replica on every
    worker (``enabled: false``) has none, so asking for it there is one line naming it."""
    on = {"policy.dtensor_cfg.enabled": "true", "policy.dtensor_cfg.cpu_offload": "true"}
    assert validate_config(_raw(**on)).policy.dtensor_cfg.cpu_offload
    with pytest.raises(UserInputError) as err:
        validate_config(_raw(**{**on, "policy.dtensor_cfg.enabled": "false"}))
    named = [line for line in str(err.value).splitlines() if "cpu_offload" in line]
    assert len(named) == 1
    assert (
        "policy.dtensor_cfg.cpu_offload is set but policy.dtensor_cfg.enabled is false: "
        "set policy.dtensor_cfg.enabled=true or remove it"
    ) in named[0]


def test_packing_needs_a_length_divisible_by_the_pad_multiple():
    raw = _raw(
        **{
            "policy.sequence_packing.enabled": "true",
            "policy.make_sequence_length_divisible_by": "7",
        }
    )
    with pytest.raises(UserInputError, match="divisible by policy.make_sequence_length"):
        validate_config(raw)
    raw["policy"]["make_sequence_length_divisible_by"] = 8
    assert validate_config(raw).policy.sequence_packing.enabled


def test_unknown_keys_name_the_path_and_the_nearest_valid_name():
    with pytest.raises(UserInputError) as err:
        validate_config(_raw(**{"policy.optimzer.lr": "0.1", "checkpointing.save_perod": "3"}))
    text = str(err.value)
    assert "policy.optimzer: unknown key (did you mean 'policy.optimizer'?)" in text
    assert (
        "checkpointing.save_perod: unknown key (did you mean 'checkpointing.save_period'?)" in text
    )


def test_yaml_file_overrides_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_raw()))
    config = load_config(path, ["sft.max_num_steps=20", "policy.optimizer.kwargs.lr=0.5"])
    assert config.sft.max_num_steps == 20 and config.policy.optimizer.lr == 0.5
    with pytest.raises(UserInputError, match="expected dotted.key=value"):
        load_config(path, ["sft.max_num_steps"])
    path.write_text("sft:\n  max_num_steps: [1\n")
    with pytest.raises(UserInputError, match=r"c.yaml line \d+: invalid YAML"):
        load_config(path)
    with pytest.raises(UserInputError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_deadline_parses_to_seconds():
    config = validate_config(_raw(**{"checkpointing.checkpoint_must_save_by": "01:02:03:04"}))
    assert config.checkpointing.deadline_seconds == ((24 + 2) * 60 + 3) * 60 + 4


def test_examples_demo_yaml_matches_the_demo_config():
    example = load_config(ROOT / "examples" / "demo.yaml")
    built = demo_config(Path("runs/demo-yaml"), Path("data/demo"), steps=150)
    assert example.model_dump() == built.model_dump()
    load_config(ROOT / "examples" / "multinode.yaml")
    assert load_config(ROOT / "examples" / "hf.yaml").policy.is_hf
    sharded = load_config(ROOT / "examples" / "fsdp.yaml")
    assert sharded.policy.dtensor_cfg.enabled and sharded.cluster.world_size == 8
    lora = load_config(ROOT / "examples" / "lora.yaml").policy  # NeMo RL's block as is
    adapters = lora.dtensor_cfg.lora_cfg
    assert adapters.enabled and adapters.dropout_position == "post" and lora.dtensor_cfg.enabled


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("data.energon.topology_mapper", "mimo", "data.energon.topology_mapper"),
        ("policy.train_global_batch_size", 6, "data-parallel size"),  # 2 workers x micro 2
        ("cluster.workers_per_node", 3, "cluster.workers_per_node = 3"),
    ],
)
def test_values_checked_only_on_the_cluster_before_are_refused_by_the_config(key, value, named):
    with pytest.raises(UserInputError, match=named):
        validate_config(_raw(**{key: value}))


def test_the_config_mappers_are_the_placement_plans():
    from typing import get_args

    from sft_runtime.runtime.data.config import EnergonConfig
    from sft_runtime.runtime.data.placement import MAPPERS

    assert get_args(EnergonConfig.model_fields["topology_mapper"].annotation) == MAPPERS


def _hf_raw(tokenizer: dict | None) -> dict:
    raw = small_raw(Path("run"), Path("data"), 3)
    raw["policy"].pop("model", None)
    raw["policy"]["model_name"] = "/models/tiny"
    if tokenizer is not None:
        raw["policy"]["tokenizer"] = tokenizer
    return raw


@pytest.mark.parametrize(
    "block",
    [
        {"chat_template": "{{ messages }}"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": True}},
    ],
)
def test_a_tokenizer_block_that_names_no_tokenizer_is_the_models_own(block):
    tokenizer = validate_config(_hf_raw(block)).policy.tokenizer
    assert tokenizer.name == "/models/tiny" and tokenizer.path == "/models/tiny"
    for key, value in block.items():
        assert getattr(tokenizer, key) == value


def test_a_tokenizer_block_that_names_another_tokenizer_keeps_it():
    block = {"name": "/tokenizers/other", "chat_template": "x"}
    assert validate_config(_hf_raw(block)).policy.tokenizer.path == "/tokenizers/other"
    with pytest.raises(UserInputError, match="policy.tokenizer.name is 'byte'"):
        validate_config(_hf_raw({"name": "byte"}))


def test_a_template_alone_under_the_own_model_is_still_refused():
    raw = small_raw(Path("run"), Path("data"), 3)
    raw["policy"]["tokenizer"] = {"chat_template": "x"}
    with pytest.raises(UserInputError, match="chat_template is only valid"):
        validate_config(raw)


@pytest.mark.parametrize(
    "key",
    ["policy.optimizer.kwargs.lr", "policy.max_grad_norm", "policy.optimizer.kwargs.weight_decay"],
)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_a_non_finite_number_is_refused_naming_its_key(tmp_path, key, value):
    """YAML spells infinity and NaN `.inf` / `.nan`: a number no step can train with."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_raw()))
    with pytest.raises(UserInputError, match=rf"{key}: Input should be a finite number"):
        load_config(config, [f"{key}={value}"])


def test_gpus_per_node_alone_runs_a_worker_per_gpu():
    """NeMo RL's `cluster.gpus_per_node: N`: N workers a node, one GPU each; with 0, CPU
    workers counted by `workers_per_node` (ours); both given and different: one line."""
    from sft_runtime.runtime.policy.cluster_config import ClusterConfig

    assert ClusterConfig(gpus_per_node=4).world_size == 4
    assert ClusterConfig(gpus_per_node=4, num_nodes=2).world_size == 8
    assert ClusterConfig(gpus_per_node=0).world_size == 2  # CPU workers, our default count
    assert ClusterConfig(gpus_per_node=0, workers_per_node=3).world_size == 3
    assert ClusterConfig(gpus_per_node=4).gpus_per_worker == 1
    with pytest.raises(ValueError, match="leave workers_per_node out"):
        ClusterConfig(gpus_per_node=4, workers_per_node=2)

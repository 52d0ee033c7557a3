"""Config files are read as NeMo RL reads them: a `defaults:` chain relative to each file,
`_override_`, `${...}` interpolation with NeMo RL's resolvers (typed after resolution), and
Hydra-style overrides; every mistake is one line naming the file, line or key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.train import _config_and_overrides
from sft_runtime.runtime.config import load_config
from sft_runtime.runtime.config_files.loader import read_config
from sft_runtime.runtime.errors import UserInputError
from tests.support.small_run import small_raw


def _write(path: Path, data: dict | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def chain(tmp_path) -> Path:
    """examples/configs/sft.yaml <- recipes/llm/recipe.yaml <- my.yaml (two defaults)."""
    base = small_raw(Path("runs/x"), tmp_path / "data")
    base["data"]["max_input_seq_length"] = "${policy.model.max_seq_len}"
    _write(tmp_path / "configs" / "sft.yaml", base)
    _write(
        tmp_path / "configs" / "recipes" / "llm" / "recipe.yaml",
        {
            "defaults": "../../sft.yaml",
            "sft": {"max_num_steps": 3, "seed": 11},
            "policy": {"train_global_batch_size": "${mul:${policy.train_micro_batch_size},4}"},
            "checkpointing": {"_override_": True, "enabled": False},
            "logger": {"log_dir": "results/sft_${sft.seed}"},
        },
    )
    _write(tmp_path / "configs" / "extra.yaml", {"policy": {"optimizer": {"kwargs": {"lr": 1e-4}}}})
    return _write(
        tmp_path / "configs" / "my.yaml",
        {"defaults": ["recipes/llm/recipe.yaml", "extra.yaml"], "sft": {"max_num_steps": 5}},
    )


def test_a_defaults_chain_merges_overrides_and_resolves_typed(chain):
    config = load_config(chain)
    assert config.sft.max_num_steps == 5  # the file over its defaults
    assert config.sft.seed == 11  # from the recipe
    assert config.policy.optimizer.lr == 1e-4  # from the second default
    assert config.policy.train_global_batch_size == 8  # ${mul:2,4}, an int after resolution
    assert config.data.max_input_seq_length == config.policy.model.max_seq_len == 64
    assert config.logger.log_dir == "results/sft_11"  # interpolation inside a string
    # `_override_`: the recipe's block replaced the base's (save_period etc. are defaults)
    assert config.checkpointing.enabled is False
    assert config.checkpointing.save_period == type(config.checkpointing)().save_period


def test_overrides_apply_before_interpolation(chain):
    config = load_config(chain, ["++sft.seed=3", "policy.train_micro_batch_size=1"])
    assert config.logger.log_dir == "results/sft_3"
    assert config.policy.train_global_batch_size == 4
    config = load_config(
        chain, ["~policy.optimizer.kwargs.lr", "+policy.optimizer.kwargs.amsgrad=true"]
    )
    assert config.policy.optimizer.lr == type(config.policy.optimizer)().lr
    assert config.policy.optimizer.kwargs["amsgrad"] is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+sft.seed=3"], r"sft.seed is already set; use \+\+sft.seed"),
        (["~sft.no_such_key"], r"sft.no_such_key is not in the config"),
        (["sft.max_num_step=3"], r"sft.max_num_step: unknown key \(did you mean"),
        (["logger.log_dir=${sft.nope}"], r"cannot resolve an interpolation"),
    ],
)
def test_a_bad_override_is_one_line_naming_the_key(chain, overrides, message):
    with pytest.raises(UserInputError, match=message):
        load_config(chain, overrides)


def test_a_defaults_cycle_a_missing_parent_and_a_duplicate_key_are_named(tmp_path):
    a = _write(tmp_path / "a.yaml", {"defaults": "b.yaml"})
    _write(tmp_path / "b.yaml", {"defaults": "a.yaml"})
    with pytest.raises(UserInputError, match="defaults chain comes back to itself"):
        read_config(a)
    c = _write(tmp_path / "c.yaml", {"defaults": "missing.yaml"})
    with pytest.raises(UserInputError, match=r"missing.yaml: no such config file"):
        read_config(c)
    _write(tmp_path / "p.yaml", "sft:\n  seed: 1\n  seed: 2\n")
    d = _write(tmp_path / "d.yaml", {"defaults": "p.yaml"})
    with pytest.raises(UserInputError, match=r"p.yaml line 3: duplicate key 'sft.seed'"):
        read_config(d)


def _args(config: str | None, option: str | None, *overrides: str) -> argparse.Namespace:
    return argparse.Namespace(
        config=config,
        config_option=None if option is None else Path(option),
        overrides=list(overrides),
    )


def test_the_config_comes_as_the_first_argument_or_as_config():
    assert _config_and_overrides(_args("a.yaml", None, "x=1")) == (Path("a.yaml"), ["x=1"])
    # `train --config a.yaml x=1 y=2`: argparse hands the first override to CONFIG
    got = _config_and_overrides(_args("x=1", "a.yaml", "y=2"))
    assert got == (Path("a.yaml"), ["x=1", "y=2"])
    with pytest.raises(UserInputError, match="two config files"):
        _config_and_overrides(_args("b.yaml", "a.yaml"))
    with pytest.raises(UserInputError, match="a config file is required"):
        _config_and_overrides(_args(None, None))


def test_an_exponent_without_a_dot_is_a_number_as_omegaconf_reads_it(tmp_path):
    """NeMo RL's sft.yaml says `eps: 1e-5`; YAML 1.1 (PyYAML) would read a string there."""
    base = _write(tmp_path / "a.yaml", small_raw(Path("runs/x"), tmp_path / "data"))
    _write(
        tmp_path / "b.yaml",
        "defaults: a.yaml\npolicy:\n  optimizer:\n    kwargs:\n      eps: 1e-5\n",
    )
    config = load_config(tmp_path / "b.yaml", ["policy.optimizer.kwargs.lr=2e-5"])
    assert config.policy.optimizer.kwargs["eps"] == 1e-5
    assert config.policy.optimizer.kwargs["lr"] == 2e-5
    config = load_config(base, ["policy.optimizer.kwargs.weight_decay=1E-2"])
    assert config.policy.optimizer.kwargs["weight_decay"] == 0.01
    # a string stays a string where it is quoted
    with pytest.raises(UserInputError, match="kwargs.lr: must be a positive number, got '1e-3'"):
        load_config(base, ["policy.optimizer.kwargs.lr='1e-3'"])

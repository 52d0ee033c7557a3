"""A LoRA config that cannot work is refused by `sft-runtime train` with exit code 2 and one
line naming the key (and, for a missing package, the line that installs it), before Ray
starts and before the run directory exists."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.fixtures import hf_overrides
from tests.support.reliability import BIN, STEPS
from tests.support.small_run import small_raw

LORA = ("policy.dtensor_cfg.lora_cfg.enabled=true",)


def _train(tmp_path: Path, demo_data: Path, *overrides: str, env: dict | None = None):
    config = tmp_path / "config.yaml"
    run_dir = tmp_path / "run"
    config.write_text(yaml.safe_dump(small_raw(run_dir, demo_data, STEPS)))
    done = subprocess.run(
        [str(BIN), "train", str(config), *overrides, "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "starting Ray" not in done.stderr
    assert not run_dir.exists()  # refused before anything was made
    return done.stderr


def test_lora_on_the_built_in_transformer(demo_data, tmp_path):
    err = _train(tmp_path, demo_data, *LORA)
    assert "policy.dtensor_cfg.lora_cfg.enabled=true needs a pretrained Hugging Face model" in err


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            (
                "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
                "policy.dtensor_cfg.lora_cfg.target_modules=[qproj]",
            ),
            "policy.dtensor_cfg.lora_cfg.target_modules[0]='qproj' matches no linear layer",
        ),
        (
            ("policy.dtensor_cfg.lora_cfg.exclude_modules=[mlp.gate]",),
            "policy.dtensor_cfg.lora_cfg.exclude_modules[0]",
        ),
        (
            ("policy.dtensor_cfg.lora_cfg.dim=0",),
            "policy.dtensor_cfg.lora_cfg.dim: Input should be greater than or equal to 1",
        ),
        (
            (
                "policy.dtensor_cfg.lora_cfg.dropout=0.1",
                "policy.dtensor_cfg.lora_cfg.dropout_position=post",
            ),
            "policy.dtensor_cfg.lora_cfg.dropout_position='post'",
        ),
        (
            (
                "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj]",
                "policy.dtensor_cfg.lora_cfg.exclude_modules=[k_proj]",
            ),
            "policy.dtensor_cfg.lora_cfg.target_modules and "
            "policy.dtensor_cfg.lora_cfg.exclude_modules are exclusive",
        ),
    ],
    ids=["target-matches-nothing", "exclude-matches-nothing", "dim-0", "post-dropout", "both"],
)
def test_lora_keys_that_cannot_work(overrides, named, demo_data, tiny_llama, tmp_path):
    err = _train(tmp_path, demo_data, *hf_overrides(tiny_llama), *LORA, *overrides)
    assert named in err


def test_lora_without_peft_installed_names_the_install_line(demo_data, tiny_llama, tmp_path):
    hidden = tmp_path / "no-peft"
    (hidden / "peft").mkdir(parents=True)
    (hidden / "peft" / "__init__.py").write_text("raise ImportError('No module named peft')\n")
    path = os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])
    err = _train(tmp_path, demo_data, *hf_overrides(tiny_llama), *LORA, env={"PYTHONPATH": path})
    assert "policy.dtensor_cfg.lora_cfg.enabled=true needs the peft package" in err
    assert "pip install 'sft-runtime[lora]'" in err

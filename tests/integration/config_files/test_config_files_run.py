"""A NeMo-RL-shaped recipe (a `defaults:` chain, interpolations) trains through the CLI."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.small_run import small_raw


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_recipe_with_defaults_trains_through_the_cli(ray_session, demo_data, tmp_path, capsys):
    """The whole path a NeMo RL user takes: `train --config RECIPE key=value ++key=value`."""
    from sft_runtime.events import read_log
    from sft_runtime.runtime.cli.main import main as cli_main

    base = small_raw(tmp_path / "unused", demo_data)
    _write(tmp_path / "configs" / "sft.yaml", base)
    recipe = _write(
        tmp_path / "configs" / "recipes" / "recipe.yaml",
        {
            "defaults": "../sft.yaml",
            "policy": {"train_global_batch_size": "${mul:${policy.train_micro_batch_size},4}"},
            "logger": {"log_dir": str(tmp_path / "results" / "sft_${sft.seed}")},
        },
    )
    rc = cli_main(["train", "--config", str(recipe), "sft.max_num_steps=2", "++sft.seed=5"])
    assert rc == 0, capsys.readouterr()
    run_dir = tmp_path / "results" / "sft_5"
    steps = [r.data for r in read_log(run_dir) if r.type == "step_committed"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["source_samples"] == 8 for s in steps)  # the interpolated global batch

"""A real three-step run (Ray, energon, torch) with validation and W&B (offline) and MLflow
turned on, as a user turns them on: both backends, read back through their own code, hold
every number of metrics.jsonl at the same step, and both runs were ended as completed when
the controller closed. ``logger.monitor_gpus`` is on too: without a GPU it changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.metrics.metrics_log import read_metrics
from sft_runtime.runtime.metrics.mlflow_log import default_tracking_uri
from tests.support.backends import (
    expected_by_step,
    mlflow_by_step,
    wandb_exit_code,
    wandb_history,
    wandb_records,
)
from tests.support.fixtures import val_overrides
from tests.support.small_run import small_config

STEPS = 3


@pytest.fixture(scope="module")
def logged_run(ray_session, val_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("backends") / "run"
    config = small_config(
        run_dir,
        val_data,
        STEPS,
        *val_overrides(val_data),  # at the start (step 0), at step 2, at the end (3)
        "logger.wandb_enabled=true",
        "logger.wandb.project=sft-it",
        "logger.wandb.name=three-steps",
        "logger.mlflow_enabled=true",
        "logger.mlflow.experiment_name=sft-it",
        "logger.mlflow.run_name=three-steps",
        "logger.monitor_gpus=true",
    )
    summary = run_training(config)
    assert summary["reason"] == "completed" and summary["total_steps"] == STEPS
    return run_dir


def test_metrics_jsonl_has_train_and_validation_rows(logged_run):
    rows = read_metrics(logged_run / "metrics.jsonl")
    assert [(r["step"], next(k for k in r if k != "step")) for r in rows] == [
        (0, "val"),
        (1, "train"),
        (2, "train"),
        (2, "val"),
        (3, "train"),
        (3, "val"),
    ]


def test_wandb_offline_run_holds_every_jsonl_number(logged_run):
    (folder,) = (logged_run / "wandb").glob("offline-run-*")
    records = wandb_records(folder)
    expected = expected_by_step(logged_run / "metrics.jsonl")
    assert {"train/loss", "train/lr", "val/val_loss"} <= set(expected[2])
    assert wandb_history(records) == expected  # no gpu/* key: no GPU here
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["project"], run["display_name"]) == ("sft-it", "three-steps")
    assert run["config"]["update"]["sft"]["max_num_steps"] == STEPS  # the run's config
    assert wandb_exit_code(records) == 0


def test_mlflow_run_holds_every_jsonl_number(logged_run):
    from mlflow.tracking import MlflowClient

    uri = default_tracking_uri(logged_run)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("sft-it")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "three-steps" and run.info.status == "FINISHED"
    assert run.data.params["sft.max_num_steps"] == str(STEPS)
    assert mlflow_by_step(uri, run.info.run_id) == expected_by_step(logged_run / "metrics.jsonl")

"""``logger.mlflow_enabled`` with the real MLflow client: by default an SQLite store in the
run directory holds, read back through `MlflowClient.get_metric_history`, every number of
metrics.jsonl at the same step under the TensorBoard names; the run's parameters are the
config; an attempt's outcome is the run's status; a tracking URI from the config or the
environment is used instead of the run's own store.

Creating an SQLite store runs MLflow's migrations (a few seconds), so the tests share one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sft_runtime.runtime.metrics.metrics_log import MetricsLogger
from sft_runtime.runtime.metrics.mlflow_log import MlflowConfig, MlflowWriter, default_tracking_uri
from tests.support.backends import expected_by_step, mlflow_by_step

RUN_CONFIG = {
    "sft": {"seed": 7, "max_num_steps": 3},
    "policy": {"optimizer": {"name": "adamw", "kwargs": {"lr": 0.003}}},
    "data": {"validation": None, "tags": ["a", "b"]},
}


def _mlflow_writer(logger: MetricsLogger) -> MlflowWriter:
    (writer,) = [b for b in logger.backends if isinstance(b, MlflowWriter)]
    return writer


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> tuple[Path, str]:
    """A run directory whose logger wrote validation at 0, steps 1-3 and validation at 3,
    and the MLflow run it made (in the run's own store)."""
    run_dir = tmp_path_factory.mktemp("mlflow") / "run"
    run_dir.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        logger = MetricsLogger(
            run_dir,
            mlflow=MlflowConfig(experiment_name="sft-dev", run_name="unit"),
            run_config=RUN_CONFIG,
        )
    run_id = _mlflow_writer(logger).run_id
    logger.log(0, {"val_loss": 2.5, "val_tokens": 120}, prefix="val")
    for step in (1, 2, 3):
        loss = 2.0 / step + 1e-9 * step
        logger.log(step, {"loss": loss, "lr": 3e-3, "valid_tokens": 40 * step, "skip": True})
    logger.log(3, {"val_loss": 1.0 / 3, "val_tokens": 120}, prefix="val")
    logger.close()
    return run_dir, run_id


def test_run_store_holds_every_jsonl_number_at_its_step(logged):
    run_dir, run_id = logged
    assert (run_dir / "mlflow.db").is_file()
    expected = expected_by_step(run_dir / "metrics.jsonl")
    assert sorted(expected) == [0, 1, 2, 3] and "train/loss" in expected[3]
    assert mlflow_by_step(default_tracking_uri(run_dir), run_id) == expected


def test_the_run_is_named_finished_and_carries_the_config(logged):
    from mlflow.tracking import MlflowClient

    run_dir, run_id = logged
    client = MlflowClient(default_tracking_uri(run_dir))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "unit"
    assert client.get_experiment(run.info.experiment_id).name == "sft-dev"
    params = run.data.params
    assert params["policy.optimizer.kwargs.lr"] == "0.003" and params["sft.seed"] == "7"
    assert params["data.validation"] == "null" and params["data.tags"] == '["a", "b"]'


@pytest.mark.parametrize(("reason", "status"), [("failed", "FAILED"), ("interrupted", "KILLED")])
def test_an_attempt_outcome_is_the_run_status(logged, tmp_path, reason, status):
    """Here the store is named by ``tracking_uri`` (the first test's), as a shared one is."""
    from mlflow.tracking import MlflowClient

    uri = default_tracking_uri(logged[0])
    logger = MetricsLogger(
        tmp_path, mlflow=MlflowConfig(experiment_name="sft-dev", tracking_uri=uri)
    )
    run_id = _mlflow_writer(logger).run_id
    logger.log(1, {"loss": 1.25})
    logger.close(reason)
    assert not (tmp_path / "mlflow.db").exists()
    assert MlflowClient(uri).get_run(run_id).info.status == status
    assert mlflow_by_step(uri, run_id) == {1: {"train/loss": 1.25}}


def test_the_environment_names_the_store_when_the_config_does_not(logged, tmp_path, monkeypatch):
    uri = default_tracking_uri(logged[0])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    logger = MetricsLogger(tmp_path, jsonl=False, mlflow=MlflowConfig())
    assert _mlflow_writer(logger).tracking_uri == uri
    logger.close()
    assert not (tmp_path / "mlflow.db").exists()

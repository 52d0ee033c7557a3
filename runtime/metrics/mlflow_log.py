"""The MLflow backend (``logger.mlflow_enabled``, NeMo RL's ``logger.mlflow`` block).

With no ``tracking_uri`` (and no ``MLFLOW_TRACKING_URI``) the run writes to an SQLite store
in the run directory, ``sqlite:///<run>/mlflow.db``: it needs no server, and it is what
MLflow 3 recommends (its file store is in maintenance mode and refuses to open unless told
to). ``mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db`` shows it. The client is
`MlflowClient`, not the fluent API, so no process-wide "active run" is touched.

Each attempt of a run is its own MLflow run in the same experiment (a resume from
checkpoint K logs from step K + 1 on); the run's parameters are the attempt's config,
flattened to dotted keys.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

MLFLOW_INSTALL = "pip install 'sft-runtime[mlflow]'"
MLFLOW_DB = "mlflow.db"
# the default SQLite store also needs these (mlflow-skinny leaves them out)
SQL_STORE_PACKAGES = ("sqlalchemy", "alembic")

# MLflow's limits on one `log_batch` call and on a parameter's value
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_CHARS = 6000

# run_stopped reasons -> MLflow's run status
_STATUS = {"failed": "FAILED", "diverged": "FAILED", "interrupted": "KILLED"}


class MlflowConfig(BaseModel):
    """NeMo RL's ``logger.mlflow`` block."""

    model_config = ConfigDict(extra="forbid")

    experiment_name: str | None = None  # None: MLflow's "Default" experiment
    run_name: str | None = None
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI, else sqlite in the run


def default_tracking_uri(run_dir: Path | str) -> str:
    """The SQLite store of a run directory."""
    return f"sqlite:///{Path(run_dir).resolve() / MLFLOW_DB}"


def tracking_uri_of(config: MlflowConfig, run_dir: Path | str) -> str:
    """Where this run's MLflow records go: the config's URI, the environment's, or the run's
    own SQLite file."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    return config.tracking_uri or env or default_tracking_uri(run_dir)


class MlflowWriter:
    """One MLflow run: scalars at the run's global steps, terminated with the attempt's
    outcome."""

    def __init__(
        self, config: MlflowConfig, run_dir: Path, *, run_config: dict[str, Any] | None = None
    ) -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri_of(config, run_dir)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment_id = self._experiment_id(config.experiment_name or "Default", run_dir)
        run = self._client.create_run(
            experiment_id,
            run_name=config.run_name,
            tags={"sft_runtime.run_dir": str(Path(run_dir).resolve())},
        )
        self.run_id: str = run.info.run_id
        if run_config:
            self._log_params(run_config)

    def _experiment_id(self, name: str, run_dir: Path) -> str:
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        # the run's own store keeps any artifacts beside it, not in the working directory
        own_store = self.tracking_uri == default_tracking_uri(run_dir)
        location = (Path(run_dir).resolve() / "mlartifacts").as_uri() if own_store else None
        return self._client.create_experiment(name, artifact_location=location)

    def _log_params(self, run_config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in _flat_params(run_config).items()]
        for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + _MAX_PARAMS_PER_BATCH])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now_ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS_PER_BATCH])

    def close(self, reason: str = "completed") -> None:
        self._client.set_terminated(self.run_id, status=_STATUS.get(reason, "FINISHED"))


def _flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"policy.optimizer.kwargs.lr": "0.003", ...}``: MLflow parameters are flat strings
    of bounded length; lists and None are written as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[name] = text[:_MAX_PARAM_CHARS]
    return out

"""Reading the logger backends back through their own code: what a W&B offline run and an
MLflow store hold, next to what metrics.jsonl says the same steps were."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from sft_runtime.runtime.metrics.metrics_log import read_metrics, scalar_metrics


def expected_by_step(metrics_jsonl: Path) -> dict[int, dict[str, float]]:
    """step -> every number metrics.jsonl holds for it, under the backends' names
    (``train/loss``, ``val/val_loss``)."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for row in read_metrics(metrics_jsonl):
        for prefix, metrics in row.items():
            if prefix != "step":
                out[row["step"]].update(scalar_metrics(metrics, prefix))
    return dict(out)


def wandb_records(run_folder: Path) -> list[dict[str, Any]]:
    """The records of an offline run's ``.wandb`` transaction log, decoded by wandb itself
    (``wandb leet inspect --json``: its Go core reads the log and prints one JSON object per
    record)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_history(records: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """step -> the metrics W&B holds at it (its own ``_step``, ``_runtime``... left out)."""
    out: dict[int, dict[str, float]] = {}
    for record in records:
        if record["type"] == "history":
            item = record["history"]["item"]
            out[int(item["_step"])] = {k: v for k, v in item.items() if not k.startswith("_")}
    return out


def wandb_exit_code(records: list[dict[str, Any]]) -> int | None:
    exits = [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"]
    return exits[-1] if exits else None


def mlflow_by_step(tracking_uri: str, run_id: str) -> dict[int, dict[str, float]]:
    """step -> the metrics an MLflow run holds at it, each key's full history read through
    `MlflowClient.get_metric_history`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for key in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, key):
            assert key not in out[metric.step], f"{key} logged twice at step {metric.step}"
            out[metric.step][key] = metric.value
    return dict(out)

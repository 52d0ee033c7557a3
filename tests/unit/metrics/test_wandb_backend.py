"""``logger.wandb_enabled`` with the real wandb library, offline: the run folder under the
run directory holds, read back by wandb's own reader, every number of metrics.jsonl at the
same step under the TensorBoard names; the run finishes with the attempt's outcome; wandb
prints nothing; ``WANDB_MODE`` is the user's to set."""

from __future__ import annotations

from pathlib import Path

import pytest

from sft_runtime.runtime.metrics.metrics_log import MetricsLogger, read_metrics
from sft_runtime.runtime.metrics.wandb_log import WandbConfig
from tests.support.backends import (
    expected_by_step,
    wandb_exit_code,
    wandb_history,
    wandb_records,
)


@pytest.fixture(autouse=True)
def _wandb_env(monkeypatch, tmp_path):
    """Offline by this runtime's default (no WANDB_MODE), and wandb's own files in the test's
    folder."""
    for name in ("WANDB_MODE", "WANDB_SILENT", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def _train(logger: MetricsLogger) -> None:
    """What a run logs: validation at the start, three steps, validation at the end."""
    logger.log(0, {"val_loss": 2.5, "val_tokens": 120}, prefix="val")
    for step in (1, 2, 3):
        logger.log(
            step,
            {
                "loss": 2.0 / step + 1e-9 * step,  # not a round number: equality is exact
                "lr": 3e-3,
                "valid_tokens": 40 * step,
                "nonfinite_skipped": True,  # a bool and a string: jsonl only
                "phase": "train",
            },
        )
    logger.log(3, {"val_loss": 1.0 / 3, "val_tokens": 120}, prefix="val")


def _run_folder(run_dir: Path) -> Path:
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    return folder


def test_offline_run_holds_every_jsonl_number_at_its_step(tmp_path, capfd):
    config = WandbConfig(project="sft-dev", name="unit", group="g", tags=["sft"])
    logger = MetricsLogger(tmp_path, wandb=config, run_config={"sft": {"seed": 7}})
    _train(logger)
    logger.close()
    out, err = capfd.readouterr()
    assert out == "" and "wandb" not in err  # no banners

    expected = expected_by_step(tmp_path / "metrics.jsonl")
    assert sorted(expected) == [0, 1, 2, 3]
    assert expected[3] == {
        "train/loss": 2.0 / 3 + 3e-9,
        "train/lr": 3e-3,
        "train/valid_tokens": 120,
        "val/val_loss": 1.0 / 3,
        "val/val_tokens": 120,
    }
    records = wandb_records(_run_folder(tmp_path))
    assert wandb_history(records) == expected
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["project"], run["display_name"], run["run_group"]) == ("sft-dev", "unit", "g")
    assert run["tags"] == ["sft"] and run["config"]["update"]["sft"] == {"seed": 7}
    assert wandb_exit_code(records) == 0
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 5  # jsonl as without wandb


def test_a_failed_attempt_finishes_its_run_as_failed(tmp_path):
    logger = MetricsLogger(tmp_path, jsonl=False, wandb=WandbConfig(project="sft-dev"))
    logger.log(1, {"loss": 1.5})
    logger.close("failed")
    logger.close("failed")  # a second close (cleanup after cleanup) does nothing
    records = wandb_records(_run_folder(tmp_path))
    assert wandb_history(records) == {1: {"train/loss": 1.5}}
    assert wandb_exit_code(records) == 1


def test_wandb_mode_from_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = MetricsLogger(tmp_path, wandb=WandbConfig(project="sft-dev"))
    logger.log(1, {"loss": 1.5})
    logger.close()
    assert not list((tmp_path / "wandb").glob("offline-run-*"))
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "train": {"loss": 1.5}}]


class _Workers:
    """The one worker-group call `end_attempt` makes besides the loaders'."""

    def flush_telemetry(self, *, deadline: float, carrier: dict | None) -> None:
        return None


@pytest.mark.parametrize(("reason", "exit_code"), [("diverged", 1), ("interrupted", 0)])
def test_the_controller_ends_the_backends_with_the_run_stopped_reason(tmp_path, reason, exit_code):
    from sft_runtime.runtime.controller.attempt import end_attempt

    logger = MetricsLogger(tmp_path, jsonl=False, wandb=WandbConfig(project="sft-dev"))
    logger.log(1, {"loss": 1.5})
    end_attempt(
        reason,
        RuntimeError("step 2 diverged") if reason == "diverged" else None,
        close_loaders=lambda: None,
        group=_Workers(),
        flush_bound_s=0.0,
        metrics=logger,
        model=None,
        log=None,
        attempt=None,
    )
    assert wandb_exit_code(wandb_records(_run_folder(tmp_path))) == exit_code

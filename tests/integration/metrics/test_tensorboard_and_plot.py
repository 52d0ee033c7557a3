"""A real three-step run (Ray, energon, torch) with ``logger.tensorboard_enabled`` on:
TensorBoard holds every step of metrics.jsonl under the same keys, and ``events --plot``
draws the run's log."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest

from sft_runtime.events import read_log
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.cli.plot import collect
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.metrics.metrics_log import read_metrics
from tests.support.small_run import small_config

STEPS = 3  # the small run's save_period: one checkpoint, at the end


@pytest.fixture(scope="module")
def tb_run(ray_session, demo_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tensorboard") / "run"
    summary = run_training(
        small_config(
            run_dir,
            demo_data,
            STEPS,
            "logger.tensorboard_enabled=true",
            "logger.tensorboard.log_dir=tb_logs",  # NeMo RL's block: a folder in the run
        )
    )
    assert summary["reason"] == "completed" and summary["total_steps"] == STEPS
    return run_dir


def _numbers(metrics: dict) -> dict[str, float]:
    return {
        k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def test_tensorboard_holds_every_step_of_metrics_jsonl_under_the_same_keys(tb_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = read_metrics(tb_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    acc = EventAccumulator(str(tb_run / "tb_logs"), size_guidance={"scalars": 0})
    acc.Reload()  # the writer was closed at the end of the run, or nothing would be read
    tags = set(acc.Tags()["scalars"])
    expected = {f"train/{key}" for key in _numbers(rows[0]["train"])}
    assert {"train/loss", "train/lr", "train/valid_tokens_per_second"} <= expected
    assert tags == expected
    for tag in tags:
        logged = {e.step: e.value for e in acc.Scalars(tag)}
        key = tag.removeprefix("train/")
        assert sorted(logged) == [1, 2, 3], tag
        for row in rows:
            want = row["train"][key]
            assert logged[row["step"]] == pytest.approx(want, rel=1e-6, abs=1e-30), (tag, row)


def test_events_plot_draws_a_real_run(tb_run, tmp_path, capsys):
    out = tmp_path / "run.png"
    assert cli_main(["events", str(tb_run), "--plot", str(out)]) == 0
    assert f"plot: {out}" in capsys.readouterr().out
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1100, 850)
    (attempt,) = collect(read_log(tb_run))
    assert attempt.steps == [1, 2, 3] and attempt.checkpoints == [3] and attempt.aborts == []
    # the plot's lr and tokens/s come from the log alone and agree with metrics.jsonl
    rows = read_metrics(tb_run / "metrics.jsonl")
    assert attempt.lr == [r["train"]["lr"] for r in rows]
    speeds = [r["train"]["valid_tokens_per_second"] for r in rows]
    assert attempt.tokens_per_s == pytest.approx(speeds, rel=1e-12)
    assert all(math.isfinite(s) and s > 0 for s in attempt.tokens_per_s)

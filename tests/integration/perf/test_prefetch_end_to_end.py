"""A real run (Ray, energon, torch) with read-ahead, in a thread or during the gradient
all-reduce: the same losses and samples as without, bit for bit, and a checkpoint taken while
batches were read ahead resumes exactly."""

from __future__ import annotations

from pathlib import Path

from sft_runtime.events import read_log, records_in_effect
from sft_runtime.runtime.checkpoint.store import CheckpointDir
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.metrics.metrics_log import read_metrics
from tests.support.small_run import small_config


def _committed(run_dir: Path) -> dict[int, tuple[float, float, list[str]]]:
    """step -> (loss, grad_norm, per-rank sample digests) over the records in effect."""
    return {
        r.data["step"]: (r.data["loss"], r.data["grad_norm"], r.data["sample_digests"])
        for r in records_in_effect(read_log(run_dir))
        if r.type == "step_committed"
    }


def test_prefetch_gives_bitwise_the_same_run_and_resumes_exactly(ray_session, demo_data, tmp_path):
    config = small_config
    off = "data_plane.load_during_allreduce=false"
    plain = run_training(config(tmp_path / "plain", demo_data, 6, off))
    ahead = run_training(config(tmp_path / "ahead", demo_data, 6, "data_plane.max_partitions=2"))
    during = run_training(config(tmp_path / "during", demo_data, 6))  # the default
    assert plain["total_steps"] == ahead["total_steps"] == during["total_steps"] == 6
    reference = _committed(tmp_path / "plain")
    assert _committed(tmp_path / "ahead") == reference
    assert _committed(tmp_path / "during") == reference
    assert ahead["consumed_samples"] == plain["consumed_samples"] == during["consumed_samples"]
    rows = read_metrics(tmp_path / "ahead" / "metrics.jsonl")
    assert all(r["train"]["loader_latency_max"] >= 0 for r in rows)

    # stop at step 3 (a checkpoint saved while the next batches were read ahead), then resume
    resumed = tmp_path / "resumed"
    first = run_training(config(resumed, demo_data, 3, "data_plane.max_partitions=3"))
    assert first["total_steps"] == 3 and 3 in CheckpointDir(resumed / "checkpoints").steps()
    second = run_training(config(resumed, demo_data, 6, "data_plane.max_partitions=3"))
    assert second["resumed_from_step"] == 3 and second["total_steps"] == 6
    assert _committed(resumed) == reference

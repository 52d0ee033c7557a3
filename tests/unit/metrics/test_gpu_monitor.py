"""``logger.monitor_gpus``: on a machine where no GPU is visible it prints exactly one line
and does nothing else (no thread, no metric); where one is, nvidia-smi's numbers are
sampled on a thread and logged per GPU at flush time, at the last step logged.

Past the CPU test, the sampler here is a stand-in: these machines have no GPU, so the
nvidia-smi path is exercised through its output format and `GpuMonitor`'s loop is driven
with made-up samples.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.metrics.gpu_monitor import (
    NO_GPU_LINE,
    GpuMonitor,
    GpuSample,
    aggregate,
    parse_nvidia_smi,
    visible_samples,
)
from sft_runtime.runtime.metrics.metrics_log import LoggerConfig, MetricsLogger, read_metrics

GIB = 1024**3
SMI = (
    "0, GPU-0a1b2c3d-0000-1111-2222-333344445555, 1024, 81559, 37\n"
    "1, GPU-9f8e7d6c-0000-1111-2222-333344445555, [N/A], 81559, [Not Supported]\n"
)


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path of a machine without a GPU")
def test_without_a_gpu_monitor_gpus_prints_one_line_and_nothing_else(tmp_path, capfd):
    config = LoggerConfig.model_validate(
        {
            "tensorboard_enabled": True,
            "monitor_gpus": True,
            "gpu_monitoring": {"collection_interval": 0.001, "flush_interval": 0.001},
        }
    )
    logger = MetricsLogger.for_run(config, tmp_path, first_step=1)
    assert not any(t.name == "gpu-monitor" for t in threading.enumerate())
    for step in (1, 2):
        logger.log(step, {"loss": 1.0 / step})
    logger.close()
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == [NO_GPU_LINE]
    assert set(_scalars(tmp_path / "tensorboard")) == {"train/loss"}  # no gpu/* tag


def test_nvidia_smi_rows_become_samples():
    first, second = parse_nvidia_smi(SMI + "\n")
    assert first == GpuSample(0, "GPU-0a1b2c3d-0000-1111-2222-333344445555", GIB, 81559 << 20, 37.0)
    assert second.index == 1 and second.memory_used_bytes is None
    assert second.utilization_percent is None  # "[Not Supported]"
    assert parse_nvidia_smi("No devices were found\n") == []


@pytest.mark.parametrize(
    ("cuda_visible", "indices"),
    [
        (None, [0, 1]),  # unset: every GPU, in nvidia-smi's order
        ("1", [1]),
        ("1,0", [1, 0]),  # this process's GPU 0 is nvidia-smi's 1
        ("GPU-9f8e", [1]),  # a UUID prefix, as CUDA takes it
        ("0,7,1", [0]),  # CUDA stops at the first entry it cannot resolve
        ("", []),
    ],
)
def test_only_the_gpus_this_process_sees_in_its_order(cuda_visible, indices):
    samples = parse_nvidia_smi(SMI)
    assert [s.index for s in visible_samples(samples, cuda_visible)] == indices


def _sample(used_gib: int, util: float) -> list[GpuSample]:
    return [GpuSample(3, "GPU-x", used_gib * GIB, 80 * GIB, util)]


def test_a_flush_logs_peak_memory_and_mean_utilisation_per_gpu():
    samples = iter([_sample(10, 20.0), _sample(30, 60.0), _sample(20, 100.0)])
    flushed: list[dict[str, float]] = []
    monitor = GpuMonitor(
        lambda: next(samples), flushed.append, collection_interval=1.0, flush_interval=1.0
    )
    monitor.flush()  # nothing sampled: nothing logged
    for _ in range(3):
        monitor.collect()
    monitor.flush()
    assert flushed == [
        {
            "gpu/0/memory_used_bytes": 30 * GIB,  # keyed by this process's numbering
            "gpu/0/memory_total_bytes": 80 * GIB,
            "gpu/0/utilization_percent": 60.0,
        }
    ]
    assert aggregate([[GpuSample(0, "u", None, None, None)]]) == {}


def test_stop_ends_the_thread_and_flushes_what_it_sampled():
    calls = 0

    def sample() -> list[GpuSample]:
        nonlocal calls
        calls += 1
        return _sample(calls, 50.0)

    flushed: list[dict[str, float]] = []
    # a flush interval longer than any test: only stop() flushes
    monitor = GpuMonitor(sample, flushed.append, collection_interval=0.001, flush_interval=1e9)
    monitor.start()
    monitor.stop()
    monitor.stop()
    assert not any(t.name == "gpu-monitor" for t in threading.enumerate())
    assert len(flushed) == 1 and calls >= 1
    assert flushed[0]["gpu/0/memory_used_bytes"] == calls * GIB  # the peak: the last sample


def test_a_failing_sampler_says_so_once_and_stops(capfd):
    def sample() -> list[GpuSample]:
        raise OSError("nvidia-smi: driver gone")

    flushed: list[dict[str, float]] = []
    monitor = GpuMonitor(sample, flushed.append, collection_interval=0.001, flush_interval=0.001)
    monitor.start()
    monitor._thread.join(timeout=30)  # it ends by itself after the first failure
    monitor.stop()
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith("logger.monitor_gpus: GPU sampling failed (OSError: nvidia-smi")
    assert flushed == []


def test_system_numbers_go_to_the_backends_at_the_last_step_not_to_jsonl(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True, first_step=5)
    logger.log_system({"gpu/0/memory_used_bytes": 2.0 * GIB})  # before any step: first_step - 1
    logger.log(5, {"loss": 0.5})
    logger.log_system({"gpu/0/memory_used_bytes": 3.0 * GIB})
    logger.close()
    scalars = _scalars(tmp_path / "tensorboard")
    assert scalars["gpu/0/memory_used_bytes"] == [(4, 2.0 * GIB), (5, 3.0 * GIB)]
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 5, "train": {"loss": 0.5}}]

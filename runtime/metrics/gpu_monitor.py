"""GPU memory and utilisation as metrics (``logger.monitor_gpus``, ``logger.gpu_monitoring``).

The process that logs (the controller actor) samples the GPUs it can see every
``collection_interval`` seconds and hands the logger one set of numbers per GPU every
``flush_interval`` seconds: the peak memory used and the mean utilisation over the samples
since the last flush, under ``gpu/<i>/memory_used_bytes``, ``gpu/<i>/memory_total_bytes``
and ``gpu/<i>/utilization_percent`` (``i`` counts the GPUs this process sees, in the order
of ``CUDA_VISIBLE_DEVICES``).

Whether a GPU is visible is torch's answer (the controller imports torch anyway); the
numbers come from ``nvidia-smi``, which ships with the NVIDIA driver and opens no CUDA
context, so the controller never takes GPU memory to watch it. NeMo RL turns this on by
default, so on a machine without a GPU it must cost nothing: one line on stderr, no thread.
Only the GPUs of the controller's node are seen; other nodes' GPUs are not sampled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

NO_GPU_LINE = (
    "logger.monitor_gpus: no GPU is visible to this process (torch.cuda.is_available() is "
    "False), so no GPU metrics are logged"
)
NO_SMI_LINE = "logger.monitor_gpus: nvidia-smi is not on PATH, so no GPU metrics are logged"
_QUERY = "index,uuid,memory.used,memory.total,utilization.gpu"
_MIB = 1024 * 1024
_SMI_TIMEOUT_S = 10.0


class GpuMonitoringConfig(BaseModel):
    """NeMo RL's ``logger.gpu_monitoring`` block (seconds)."""

    model_config = ConfigDict(extra="forbid")

    collection_interval: float = Field(10.0, gt=0)
    flush_interval: float = Field(10.0, gt=0)


@dataclass(frozen=True)
class GpuSample:
    """One GPU as ``nvidia-smi`` reported it; None where it said ``[N/A]`` (MIG, some
    virtual GPUs)."""

    index: int  # nvidia-smi's (PCI order), not necessarily this process's
    uuid: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_percent: float | None


def parse_nvidia_smi(text: str) -> list[GpuSample]:
    """The rows of ``nvidia-smi --query-gpu=<_QUERY> --format=csv,noheader,nounits``."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5 or not fields[0].isdigit():
            continue
        index, uuid, used, total, util = fields
        samples.append(
            GpuSample(
                int(index),
                uuid,
                _mib(used),
                _mib(total),
                _number(util),
            )
        )
    return samples


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def _mib(text: str) -> int | None:
    value = _number(text)
    return None if value is None else int(value) * _MIB


def visible_samples(samples: Sequence[GpuSample], cuda_visible: str | None) -> list[GpuSample]:
    """The GPUs this process sees, in its own order: ``CUDA_VISIBLE_DEVICES`` lists indices
    or UUIDs (a prefix of one is enough, as CUDA accepts); unset means all of them."""
    if cuda_visible is None:
        return list(samples)
    chosen = []
    for entry in (e.strip() for e in cuda_visible.split(",")):
        if not entry:
            break
        match = [
            s
            for s in samples
            if (entry.isdigit() and s.index == int(entry))
            or (not entry.isdigit() and s.uuid.startswith(entry))
        ]
        if not match:
            break  # CUDA stops at the first entry it cannot resolve
        chosen.append(match[0])
    return chosen


def sample_nvidia_smi() -> list[GpuSample]:
    """Every GPU of this node, now."""
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=_SMI_TIMEOUT_S,
        check=True,
    )
    return parse_nvidia_smi(out.stdout)


class GpuMonitor:
    """Samples on a daemon thread and hands the sink one aggregate per flush interval;
    `stop` flushes what is left (taking one sample first if none was taken), so a run
    shorter than the interval still logs its GPUs once."""

    def __init__(
        self,
        sample: Callable[[], Sequence[GpuSample]],
        sink: Callable[[dict[str, float]], None],
        *,
        collection_interval: float,
        flush_interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sample = sample
        self._sink = sink
        self._collection_interval = collection_interval
        self._flush_interval = flush_interval
        self._clock = clock
        self._buffer: list[Sequence[GpuSample]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def collect(self) -> None:
        self._buffer.append(self._sample())

    def flush(self) -> None:
        buffered, self._buffer = self._buffer, []
        metrics = aggregate(buffered)
        if metrics:
            self._sink(metrics)

    def start(self) -> GpuMonitor:
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread and flushes; safe to call twice."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join(timeout=_SMI_TIMEOUT_S + 5.0)
        if self._failed:
            return
        try:
            if not self._buffer:
                self.collect()
            self.flush()
        except Exception as exc:  # noqa: BLE001 - monitoring never fails the run
            _say(f"logger.monitor_gpus: GPU sampling failed ({type(exc).__name__}: {exc})")

    def _run(self) -> None:
        next_flush = self._clock() + self._flush_interval
        while not self._stop.wait(self._collection_interval):
            try:
                self.collect()
                if self._clock() >= next_flush:
                    self.flush()
                    next_flush = self._clock() + self._flush_interval
            except Exception as exc:  # noqa: BLE001 - monitoring never fails the run
                self._failed = True
                _say(
                    f"logger.monitor_gpus: GPU sampling failed ({type(exc).__name__}: {exc}); "
                    "no more GPU metrics are logged"
                )
                return


def aggregate(buffered: Sequence[Sequence[GpuSample]]) -> dict[str, float]:
    """Per GPU (by position in each sample): the peak memory used, the last total, the mean
    utilisation, over the samples of one flush interval."""
    out: dict[str, float] = {}
    width = max((len(s) for s in buffered), default=0)
    for i in range(width):
        rows = [s[i] for s in buffered if len(s) > i]
        used = [r.memory_used_bytes for r in rows if r.memory_used_bytes is not None]
        total = [r.memory_total_bytes for r in rows if r.memory_total_bytes is not None]
        util = [r.utilization_percent for r in rows if r.utilization_percent is not None]
        if used:
            out[f"gpu/{i}/memory_used_bytes"] = max(used)
        if total:
            out[f"gpu/{i}/memory_total_bytes"] = total[-1]
        if util:
            out[f"gpu/{i}/utilization_percent"] = sum(util) / len(util)
    return out


def visible_gpu_count() -> int:
    """How many CUDA GPUs this process sees (torch's count; 0 where torch is missing)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def start_gpu_monitor(
    config: GpuMonitoringConfig, sink: Callable[[dict[str, float]], None]
) -> GpuMonitor | None:
    """A started monitor, or None after one line on stderr where there is nothing to watch
    (no GPU visible, or no ``nvidia-smi``)."""
    if visible_gpu_count() == 0:
        _say(NO_GPU_LINE)
        return None
    if shutil.which("nvidia-smi") is None:
        _say(NO_SMI_LINE)
        return None

    def sample() -> list[GpuSample]:
        return visible_samples(sample_nvidia_smi(), os.environ.get("CUDA_VISIBLE_DEVICES"))

    return GpuMonitor(
        sample,
        sink,
        collection_interval=config.collection_interval,
        flush_interval=config.flush_interval,
    ).start()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

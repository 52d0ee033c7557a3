"""Per-step metrics: one JSON line per step in ``<log_dir>/metrics.jsonl`` (and TensorBoard).

The event log is the record of truth; this file is for plotting, so it is flushed every
line but never fsynced.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import orjson


class MetricsLogger:
    def __init__(self, log_dir: Path | str, *, jsonl: bool = True, tensorboard: bool = False):
        self.path = Path(log_dir) / "metrics.jsonl"
        self._fh = open(self.path, "ab") if jsonl else None  # noqa: SIM115 - closed in close()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(log_dir) / "tensorboard"))
            except ImportError:
                warnings.warn(
                    "logger.tensorboard is on but tensorboard is not installed; "
                    "metrics go to metrics.jsonl only",
                    stacklevel=2,
                )

    def log(self, step: int, metrics: dict[str, Any], *, prefix: str = "train") -> None:
        if self._fh is not None:
            self._fh.write(orjson.dumps({"step": step, prefix: metrics}) + b"\n")
            self._fh.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """All lines of a metrics file (skipping a torn last line)."""
    rows = []
    for line in Path(path).read_bytes().splitlines():
        try:
            rows.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return rows

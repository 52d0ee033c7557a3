"""Per-step metrics: one JSON line per step in ``<log_dir>/metrics.jsonl``, and TensorBoard.

The event log is the record of truth; these files are for plotting, so both are flushed
every step but never fsynced. With ``logger.tensorboard_enabled`` on, the same numbers go to event
files under ``<log_dir>/tensorboard/``: the JSON line ``{"step": N, "train": {"loss": x}}``
becomes the scalar ``train/loss`` at global step N, so a key means the same in both places.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_INSTALL = "pip install 'sft-runtime[tensorboard]'"


class TensorboardConfig(BaseModel):
    """NeMo RL's ``logger.tensorboard`` block: where the event files go, under the run."""

    model_config = ConfigDict(extra="forbid")

    log_dir: str = TENSORBOARD_DIR  # relative to the metrics' folder (the run directory)


class LoggerConfig(BaseModel):
    """NeMo RL's ``logger`` keys where this runtime has the backend; ``log_dir`` is the run
    directory (the event log, metrics and traces live there), not a folder of loggers."""

    model_config = ConfigDict(extra="forbid")

    log_dir: str | None = None  # default: the run directory
    jsonl: bool = True
    tensorboard_enabled: bool = False  # NeMo RL's name; an optional extra
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)

    @model_validator(mode="before")
    @classmethod
    def _nemo_rl_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("tensorboard"), bool):
            raise ValueError(
                "logger.tensorboard is NeMo RL's block {log_dir: ...}; TensorBoard is turned "
                f"on by logger.tensorboard_enabled: {str(data['tensorboard']).lower()}"
            )
        return data

    @field_validator("tensorboard_enabled")
    @classmethod
    def _tensorboard_installed(cls, value: bool) -> bool:
        # refused here, before Ray starts, rather than found missing in the controller
        if value and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                f"the tensorboard package is not installed: {TENSORBOARD_INSTALL} "
                "(or set logger.tensorboard_enabled=false)"
            )
        return value


class MetricsLogger:
    """Writes each step's metrics to the backends ``logger`` turns on; `close` ends them."""

    def __init__(
        self,
        log_dir: Path | str,
        *,
        jsonl: bool = True,
        tensorboard: bool = False,
        tensorboard_dir: str = TENSORBOARD_DIR,
        first_step: int = 1,
    ) -> None:
        self.path = Path(log_dir) / "metrics.jsonl"
        self._fh = open(self.path, "ab") if jsonl else None  # noqa: SIM115 - closed in close()
        self._tb = (
            _summary_writer(Path(log_dir) / tensorboard_dir, first_step) if tensorboard else None
        )

    @classmethod
    def for_run(
        cls, logger_config: LoggerConfig, run_dir: Path | str, *, first_step: int
    ) -> MetricsLogger:
        """The logger of one attempt from the ``logger`` section; ``first_step`` is the step
        the attempt starts at (a resume from checkpoint K starts at K + 1)."""
        return cls(
            logger_config.log_dir or run_dir,
            jsonl=logger_config.jsonl,
            tensorboard=logger_config.tensorboard_enabled,
            tensorboard_dir=logger_config.tensorboard.log_dir,
            first_step=first_step,
        )

    def log(self, step: int, metrics: dict[str, Any], *, prefix: str = "train") -> None:
        if self._fh is not None:
            self._fh.write(orjson.dumps({"step": step, prefix: metrics}) + b"\n")
            self._fh.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if _is_scalar(value):
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _summary_writer(directory: Path, first_step: int) -> Any:
    """A TensorBoard writer, imported only here so runs without it never load tensorboard.

    On a resume (``first_step`` > 1) the writer starts with a purge mark: TensorBoard then
    hides what earlier attempts wrote from ``first_step`` on, the steps the resume rolled
    back, as the event log's lineage does. Config validation refuses ``logger.tensorboard_enabled``
    when the package is missing; a worker node without it still trains, with a warning.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            f"logger.tensorboard_enabled is on but tensorboard is not installed here "
            f"({TENSORBOARD_INSTALL}); metrics go to metrics.jsonl only",
            stacklevel=3,
        )
        return None
    return SummaryWriter(str(directory), purge_step=first_step if first_step > 1 else None)


def _is_scalar(value: Any) -> bool:
    """Numbers TensorBoard can chart: ints and floats, not bools or strings."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """All lines of a metrics file (skipping a torn last line)."""
    rows = []
    for line in Path(path).read_bytes().splitlines():
        try:
            rows.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return rows

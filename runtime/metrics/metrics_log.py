"""Per-step metrics: one JSON line per step in ``<log_dir>/metrics.jsonl``, and the backends
of NeMo RL's ``logger`` section (TensorBoard, Weights & Biases, MLflow, GPU monitoring).

The event log is the record of truth; these are for plotting, so they are flushed every step
but never fsynced. Every backend gets the same numbers under the same names: the JSON line
``{"step": N, "train": {"loss": x}}`` becomes the scalar ``train/loss`` at global step N (and
a validation entry ``val/val_loss``), so a key means the same everywhere. Each backend is a
module of its own (`tensorboard_log`, `wandb_log`, `mlflow_log`, `gpu_monitor`) that imports
its library only when turned on; `MetricsLogger` fans out to them. GPU numbers go to the
backends, not to metrics.jsonl, whose rows are steps.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sft_runtime.runtime.metrics.gpu_monitor import (
    GpuMonitor,
    GpuMonitoringConfig,
    start_gpu_monitor,
)
from sft_runtime.runtime.metrics.mlflow_log import (
    MLFLOW_INSTALL,
    SQL_STORE_PACKAGES,
    MlflowConfig,
    MlflowWriter,
)
from sft_runtime.runtime.metrics.tensorboard_log import (
    TENSORBOARD_DIR,
    TENSORBOARD_INSTALL,
    TensorboardConfig,
    open_tensorboard,
)
from sft_runtime.runtime.metrics.wandb_log import WANDB_INSTALL, WandbConfig, WandbWriter

__all__ = [
    "TENSORBOARD_DIR",
    "TENSORBOARD_INSTALL",
    "WANDB_INSTALL",
    "MLFLOW_INSTALL",
    "LoggerConfig",
    "MetricsLogger",
    "SwanlabConfig",
    "read_metrics",
    "scalar_metrics",
]


class SwanlabConfig(BaseModel):
    """NeMo RL's ``logger.swanlab`` block: accepted so NeMo RL's files load; inert."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = None
    name: str | None = None


class LoggerConfig(BaseModel):
    """NeMo RL's ``logger`` keys; ``log_dir`` is the run directory (the event log, metrics
    and traces live there), not a folder of loggers. A backend turned on whose package is
    missing is refused here, before Ray starts, naming the key and the install command."""

    model_config = ConfigDict(extra="forbid")

    log_dir: str | None = "logs"  # NeMo RL's; the run directory here (class doc)
    jsonl: bool = True
    # NeMo RL's default (true) where the optional extra is installed; without it, off
    tensorboard_enabled: bool = Field(default_factory=lambda: _present("tensorboard"))
    # NeMo RL's default is true; here a run reaches a third-party service only when asked
    wandb_enabled: bool = False
    # the block before its switch: the switch's check reads the block's tracking_uri
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    mlflow_enabled: bool = False  # an optional extra
    swanlab_enabled: bool = False  # accepted off only
    monitor_gpus: bool = True  # NeMo RL's: one line says so where there is no GPU
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    swanlab: SwanlabConfig = Field(default_factory=SwanlabConfig)
    gpu_monitoring: GpuMonitoringConfig = Field(default_factory=GpuMonitoringConfig)

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
        return _installed(value, "tensorboard_enabled", ("tensorboard",), TENSORBOARD_INSTALL)

    @field_validator("wandb_enabled")
    @classmethod
    def _wandb_installed(cls, value: bool) -> bool:
        return _installed(value, "wandb_enabled", ("wandb",), WANDB_INSTALL)

    @field_validator("swanlab_enabled")
    @classmethod
    def _no_swanlab(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "SwanLab is not supported here (set logger.swanlab_enabled=false; "
                "logger.wandb_enabled, logger.mlflow_enabled and "
                "logger.tensorboard_enabled are)"
            )
        return value

    @field_validator("mlflow_enabled")
    @classmethod
    def _mlflow_installed(cls, value: bool, info: ValidationInfo) -> bool:
        # the default store (SQLite in the run) needs SQLAlchemy too; a server URI does not
        block = info.data.get("mlflow")
        uri = (block.tracking_uri if block else None) or os.environ.get("MLFLOW_TRACKING_URI")
        sqlite = uri is None or uri.startswith("sqlite:")
        packages = ("mlflow", *(SQL_STORE_PACKAGES if sqlite else ()))
        return _installed(value, "mlflow_enabled", packages, MLFLOW_INSTALL)


def _present(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _installed(enabled: bool, key: str, packages: tuple[str, ...], install: str) -> bool:
    """``enabled`` unless a package it needs is missing: refused with the install command
    (pydantic puts the key, ``logger.<key>``, in front of the line)."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None] if enabled else []
    if missing:
        names = " and ".join(missing)
        raise ValueError(
            f"the {names} package{'s are' if len(missing) > 1 else ' is'} not installed: "
            f"{install} (or set logger.{key}=false)"
        )
    return enabled


class ScalarBackend(Protocol):
    """What the logger fans out to: scalars at a global step; closed with the run_stopped
    reason of the attempt (``completed``, ``failed``, ``interrupted``, ...)."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self, reason: str = "completed") -> None: ...


class MetricsLogger:
    """Writes each step's metrics to the backends ``logger`` turns on; `close` ends them.

    Safe to call from two threads (the training loop and the GPU monitor): one lock orders
    the writes, and a GPU sample is logged at the last step the loop logged.
    """

    def __init__(
        self,
        log_dir: Path | str,
        *,
        jsonl: bool = True,
        tensorboard: bool = False,
        tensorboard_dir: str = TENSORBOARD_DIR,
        first_step: int = 1,
        wandb: WandbConfig | None = None,
        mlflow: MlflowConfig | None = None,
        gpu_monitoring: GpuMonitoringConfig | None = None,
        run_config: dict[str, Any] | None = None,
        killed_at_end: bool = False,
    ) -> None:
        log_dir = Path(log_dir)
        self.path = log_dir / "metrics.jsonl"
        self._lock = threading.Lock()
        self._step = first_step - 1  # where GPU samples go before the first step is logged
        self._fh = None
        self.backends: list[ScalarBackend] = []
        self._gpu: GpuMonitor | None = None
        try:  # a backend that fails to open closes the ones already open
            self._fh = open(self.path, "ab") if jsonl else None  # noqa: SIM115 - close()
            self._open_backends(
                log_dir,
                tensorboard_dir,
                first_step,
                tensorboard,
                wandb,
                mlflow,
                run_config,
                killed_at_end,
            )
            if gpu_monitoring is not None:
                self._gpu = start_gpu_monitor(gpu_monitoring, self.log_system)
        except BaseException:
            self.close("failed")
            raise

    def _open_backends(
        self,
        log_dir: Path,
        tensorboard_dir: str,
        first_step: int,
        tensorboard: bool,
        wandb: WandbConfig | None,
        mlflow: MlflowConfig | None,
        run_config: dict[str, Any] | None,
        killed_at_end: bool,
    ) -> None:
        if tensorboard:
            writer = open_tensorboard(log_dir / tensorboard_dir, first_step)
            if writer is not None:
                self.backends.append(writer)
        if wandb is not None:
            self.backends.append(
                WandbWriter(wandb, log_dir, run_config=run_config, killed_at_end=killed_at_end)
            )
        if mlflow is not None:
            self.backends.append(MlflowWriter(mlflow, log_dir, run_config=run_config))

    @classmethod
    def for_run(
        cls,
        logger_config: LoggerConfig,
        run_dir: Path | str,
        *,
        first_step: int,
        run_config: dict[str, Any] | None = None,
        killed_at_end: bool = False,
    ) -> MetricsLogger:
        """The logger of one attempt from the ``logger`` section; ``first_step`` is the step
        the attempt starts at (a resume from checkpoint K starts at K + 1); ``run_config``
        (the whole config, as plain data) becomes the W&B config and the MLflow params;
        ``killed_at_end``: this process is killed after `close`, its exit hooks never run
        (a Ray actor), so the backends clean up after their libraries when they close."""
        c = logger_config
        return cls(
            run_dir,
            jsonl=c.jsonl,
            tensorboard=c.tensorboard_enabled,
            tensorboard_dir=c.tensorboard.log_dir,
            first_step=first_step,
            wandb=c.wandb if c.wandb_enabled else None,
            mlflow=c.mlflow if c.mlflow_enabled else None,
            gpu_monitoring=c.gpu_monitoring if c.monitor_gpus else None,
            run_config=run_config,
            killed_at_end=killed_at_end,
        )

    def log(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "train") -> None:
        with self._lock:
            self._step = max(self._step, step)
            if self._fh is not None:
                self._fh.write(orjson.dumps({"step": step, prefix: metrics}) + b"\n")
                self._fh.flush()
            scalars = scalar_metrics(metrics, prefix)
            if scalars:
                for backend in self.backends:
                    backend.log(step, scalars)

    def log_system(self, scalars: dict[str, float]) -> None:
        """Numbers sampled by time, not by step (the GPU monitor's), already under their
        backend names: logged at the last step logged, so every backend sees steps that
        never go back. Not written to metrics.jsonl, whose rows are steps."""
        with self._lock:
            for backend in self.backends:
                backend.log(self._step, scalars)

    def close(self, reason: str = "completed") -> None:
        """Stops the GPU monitor (its last numbers logged), then ends every backend with the
        attempt's outcome (``reason``: run_stopped's); each is closed even if one fails, and
        the first failure is raised after. Safe to call twice."""
        errors: list[BaseException] = []
        gpu, self._gpu = self._gpu, None
        if gpu is not None:
            _collect(errors, gpu.stop)
        with self._lock:
            fh, self._fh = self._fh, None
            backends, self.backends = self.backends, []
        if fh is not None:
            _collect(errors, fh.close)
        for backend in backends:
            _collect(errors, lambda b=backend: b.close(reason))
        if errors:
            raise errors[0]


def _collect(errors: list[BaseException], fn: Any) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - raised by close() once all are closed
        errors.append(exc)


def scalar_metrics(metrics: dict[str, Any], prefix: str) -> dict[str, float]:
    """The numbers of a metrics entry under their backend names (``train/loss``): ints and
    floats, not bools or strings, which no backend can chart."""
    return {f"{prefix}/{k}": v for k, v in metrics.items() if _is_scalar(v)}


def _is_scalar(value: Any) -> bool:
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

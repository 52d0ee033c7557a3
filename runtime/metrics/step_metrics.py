"""What one step measured, from the loader envelopes and the workers' results.

Pure functions of plain data, so the controller stays a sequence of calls and the numbers
are testable without Ray. `MetricsLogger` (at the end) writes them where the config says.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, Protocol, TypedDict

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sft_runtime.runtime.data.batch import StepEnvelope
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

LOADER_LATENCY_MAX_KEY = "loader_latency_max"
POLICY_TIME_KEY = "policy_time"
TOTAL_STEP_TIME_KEY = "total_step_time"
VALID_TOKENS_PER_SECOND_KEY = "valid_tokens_per_second"
WORKER_TIME_KEYS = ("forward_backward_s", "allreduce_s", "optimizer_s")
# Samples of a step that trained on nothing or less than they hold (see task_encoder.py).
SAMPLE_COUNT_KEYS = ("overlong_samples", "skipped_samples")
STEP_METRIC_KEYS = (
    "loss",
    "grad_norm",
    "lr",
    "valid_tokens",
    "source_samples",
    "physical_packs",
    *SAMPLE_COUNT_KEYS,
    LOADER_LATENCY_MAX_KEY,
    "loader_latency_mean",
    "loader_copy_imbalance",
    "load_time",
    POLICY_TIME_KEY,
    TOTAL_STEP_TIME_KEY,
    VALID_TOKENS_PER_SECOND_KEY,
    *WORKER_TIME_KEYS,
)
"""Every key `step_metrics` may return: what ``checkpointing.metric_name`` can rank by."""


class StepMetrics(TypedDict):
    """One step's metrics, as `step_metrics` derives them (`STEP_METRIC_KEYS`): logged to
    metrics.jsonl, its timings recorded in step_committed, ranked by checkpoints."""

    loss: float
    grad_norm: float
    lr: float
    valid_tokens: int  # supervised target tokens of the global batch
    source_samples: int  # conversations
    physical_packs: int  # rows
    overlong_samples: int
    skipped_samples: int
    loader_latency_max: float  # the slowest data shard's load
    loader_latency_mean: float
    loader_copy_imbalance: float  # most tokens on a shard over the mean
    load_time: float
    policy_time: float  # the step's time to its gradients applied, less the load
    total_step_time: float
    valid_tokens_per_second: float
    forward_backward_s: NotRequired[float]  # the slowest worker's
    allreduce_s: NotRequired[float]
    optimizer_s: NotRequired[float]
    # 1 on a non-finite step committed without its update (sft.skip_nonfinite_steps)
    nonfinite_skipped: NotRequired[int]


class FinishedStep(Protocol):
    """What `step_metrics` reads of a worker's finished step: the policy's
    `results.StepFinished` is one (the workers sit above this folder, so it is named here by
    what it offers, read only)."""

    @property
    def loss(self) -> float: ...
    @property
    def grad_norm(self) -> float: ...
    @property
    def lr(self) -> float: ...
    @property
    def forward_backward_s(self) -> float: ...
    @property
    def allreduce_s(self) -> float: ...
    @property
    def optimizer_s(self) -> float: ...


def sample_digest(source_ids: Sequence[str]) -> str:
    """A short digest of one logical rank's source ids, in order."""
    return hashlib.sha256("\n".join(source_ids).encode()).hexdigest()[:32]


def check_envelopes(envelopes: Sequence[StepEnvelope], logical_world_size: int) -> None:
    ranks = [e.logical_rank for e in envelopes]
    if ranks != list(range(logical_world_size)):
        raise RuntimeError(
            f"loader envelopes came back for logical ranks {ranks}, "
            f"expected 0..{logical_world_size - 1} in order"
        )


def step_metrics(
    envelopes: Sequence[StepEnvelope],
    results: Sequence[FinishedStep],
    *,
    trained_s: float,
    total_time: float,
) -> StepMetrics:
    """The metric keys of one step (logged to metrics.jsonl and the step_committed record):
    ``trained_s`` from the step's start to its gradients applied, of which the slowest
    loader's time is loading and the rest the policy's."""
    load_time = max((e.load_seconds for e in envelopes), default=0.0)
    policy_time = trained_s - load_time
    latencies = [e.load_seconds for e in envelopes]
    tokens = [e.valid_tokens for e in envelopes]
    mean_tokens = sum(tokens) / len(tokens) if tokens else 0.0
    valid_tokens = sum(tokens)
    head = results[0]
    metrics = StepMetrics(
        loss=float(head.loss),
        grad_norm=float(head.grad_norm),
        lr=float(head.lr),
        valid_tokens=valid_tokens,
        source_samples=sum(len(e.source_ids) for e in envelopes),
        physical_packs=sum(e.physical_packs for e in envelopes),
        overlong_samples=sum(e.overlong_samples for e in envelopes),
        skipped_samples=sum(e.skipped_samples for e in envelopes),
        loader_latency_max=max(latencies, default=0.0),
        loader_latency_mean=sum(latencies) / len(latencies) if latencies else 0.0,
        loader_copy_imbalance=(max(tokens) / mean_tokens) if mean_tokens else 1.0,
        load_time=load_time,
        policy_time=policy_time,
        total_step_time=total_time,
        valid_tokens_per_second=valid_tokens / total_time if total_time > 0 else 0.0,
    )
    if results:  # the slowest rank's
        metrics["forward_backward_s"] = max(float(r.forward_backward_s) for r in results)
        metrics["allreduce_s"] = max(float(r.allreduce_s) for r in results)
        metrics["optimizer_s"] = max(float(r.optimizer_s) for r in results)
    return metrics


@dataclass(frozen=True)
class TeedMetric:
    """A logger key mirrored to an OpenTelemetry instrument."""

    key: str
    instrument: str
    unit: str
    description: str


SFT_V2_TEED_METRICS: tuple[TeedMetric, ...] = (
    TeedMetric(
        LOADER_LATENCY_MAX_KEY,
        "rl.sft_v2.loader.latency.max",
        "s",
        "Slowest loader owner's time to deliver its batch",
    ),
    TeedMetric(POLICY_TIME_KEY, "rl.sft_v2.policy.duration", "s", "Policy training time of a step"),
    TeedMetric(TOTAL_STEP_TIME_KEY, "rl.sft_v2.step.duration", "s", "Wall time of a whole step"),
    TeedMetric(
        VALID_TOKENS_PER_SECOND_KEY,
        "rl.sft_v2.valid_tokens_per_second",
        "{token}/s",
        "Supervised tokens trained per second",
    ),
)

TIMING_KEYS = (
    LOADER_LATENCY_MAX_KEY,
    "loader_latency_mean",
    "load_time",
    POLICY_TIME_KEY,
    TOTAL_STEP_TIME_KEY,
    "forward_backward_s",
    "allreduce_s",
    "optimizer_s",
)


def step_timings(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The timing metrics a ``step_committed`` record carries."""
    return {k: float(metrics[k]) for k in TIMING_KEYS if k in metrics}


def step_attributes(metrics: Mapping[str, Any], consumed_samples: int) -> dict[str, Any]:
    """Attributes of a finished ``rl.sft_v2.step`` span; durations say their unit (the span's
    own extent, ``total_step_time_s``, is added when it is drawn: `StepTrace.end`)."""
    return {
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "valid_tokens": metrics["valid_tokens"],
        "consumed_samples": consumed_samples,
        "policy_time_s": metrics[POLICY_TIME_KEY],
        "load_time_s": metrics["load_time"],
    }


class RunSummary(TypedDict):
    """What `SFTController.run` returns to the driver, and `run_training` to its caller: how
    the attempt ended and where the run stands (a dict, so code written against the seed's
    keys reads it unchanged)."""

    reason: str  # completed, interrupted, timeout, failed, diverged
    attempt: int
    resumed_from_step: int | None
    steps_run: int
    total_steps: int
    max_steps: int
    consumed_samples: int
    total_valid_tokens: int
    first_loss: float | None
    last_loss: float | None
    checkpoints: list[int]
    run_dir: str
    overlong_samples: int  # this attempt's (`SAMPLE_COUNT_KEYS`)
    skipped_samples: int
    nonfinite_skipped: int  # steps committed without their update
    telemetry_flush_by: NotRequired[float | None]  # the deadline the workers flushed spans against


def run_summary(
    state: Any,
    *,
    reason: str,
    attempt: int,
    start_step: int,
    max_steps: int,
    losses: Sequence[float],
    checkpoints: list[int],
    run_dir: Any,
    sample_counts: dict[str, int] | None = None,
    nonfinite_skipped: int = 0,
) -> RunSummary:
    """What `SFTController.run` returns: how the attempt ended and where the run stands."""
    counts = sample_counts or {}
    return {
        "reason": reason,
        "attempt": attempt,
        "resumed_from_step": start_step or None,
        "steps_run": state.total_steps - start_step,
        "total_steps": state.total_steps,
        "max_steps": max_steps,
        "consumed_samples": state.consumed_samples,
        "total_valid_tokens": state.total_valid_tokens,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "checkpoints": checkpoints,
        "run_dir": str(run_dir),
        "overlong_samples": counts.get("overlong_samples", 0),
        "skipped_samples": counts.get("skipped_samples", 0),
        "nonfinite_skipped": nonfinite_skipped,
    }


@dataclass
class RunTally:
    """What an attempt's committed steps add up to: the run's summary and the metrics a
    checkpoint is ranked by (the last step's)."""

    last: dict[str, Any] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    sample_counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(SAMPLE_COUNT_KEYS, 0)
    )
    nonfinite_skipped: int = 0

    def add(self, metrics: StepMetrics) -> None:
        """A committed step's metrics (`step_metrics`)."""
        self.last = dict(metrics)
        self.losses.append(metrics["loss"])
        self.nonfinite_skipped += metrics.get("nonfinite_skipped", 0)
        for key in SAMPLE_COUNT_KEYS:
            self.sample_counts[key] += metrics[key]


# ---------------------------------------------------------------------- where the metrics go
# Per-step metrics: one JSON line per step in ``<log_dir>/metrics.jsonl``, and the backends
# of NeMo RL's ``logger`` section (TensorBoard, Weights & Biases, MLflow, GPU monitoring).
#
# The event log is the record of truth; these are for plotting, so they are flushed every step
# but never fsynced. Every backend gets the same numbers under the same names: the JSON line
# ``{"step": N, "train": {"loss": x}}`` becomes the scalar ``train/loss`` at global step N (and
# a validation entry ``val/val_loss``), so a key means the same everywhere. Each backend is a
# module of its own (`tensorboard_log`, `wandb_log`, `mlflow_log`, `gpu_monitor`) that imports
# its library only when turned on; `MetricsLogger` fans out to them. GPU numbers go to the
# backends, not to metrics.jsonl, whose rows are steps.


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
                log_dir, tensorboard_dir, first_step, tensorboard, wandb, mlflow, run_config
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
    ) -> None:
        if tensorboard:
            writer = open_tensorboard(log_dir / tensorboard_dir, first_step)
            if writer is not None:
                self.backends.append(writer)
        if wandb is not None:
            self.backends.append(WandbWriter(wandb, log_dir, run_config=run_config))
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
    ) -> MetricsLogger:
        """The logger of one attempt from the ``logger`` section; ``first_step`` is the step
        the attempt starts at (a resume from checkpoint K starts at K + 1); ``run_config``
        (the whole config, as plain data) becomes the W&B config and the MLflow params."""
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

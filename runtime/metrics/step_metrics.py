"""What one step measured, from the loader envelopes and the workers' results.

Pure functions of plain data, so the controller stays a sequence of calls and the numbers
are testable without Ray.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, Protocol, TypedDict

from sft_runtime.runtime.data.batch import StepEnvelope

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
    telemetry_flush_s: NotRequired[float]  # what the controller's flush left of the bound


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

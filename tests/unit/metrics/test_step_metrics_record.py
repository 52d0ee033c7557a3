"""The step's metrics are a named record whose keys are the ones a checkpoint may rank by."""

from __future__ import annotations

from sft_runtime.runtime.data.batch import StepEnvelope
from sft_runtime.runtime.metrics.step_metrics import STEP_METRIC_KEYS, StepMetrics, step_metrics
from sft_runtime.runtime.policy.step_outcome import StepFinished


def test_the_record_names_every_rankable_key():
    assert set(StepMetrics.__annotations__) - {"nonfinite_skipped"} == set(STEP_METRIC_KEYS)


def test_a_step_of_two_shards_fills_every_key():
    envelopes = [
        StepEnvelope(rank, 2, [f"s{rank}", "t"], ["input_ids"], [10, 4], 0.25 * (rank + 1), 9, 1)
        for rank in range(2)
    ]
    finished = [StepFinished(2.0, 1.0, 0.1, 18, 9, [], 0.01, 0.02, 0.03, step=1)] * 2
    metrics = step_metrics(envelopes, finished, trained_s=2.0, total_time=3.0)
    assert set(metrics) == set(STEP_METRIC_KEYS)
    assert metrics["source_samples"] == 4 and metrics["valid_tokens"] == 18
    assert metrics["loader_latency_max"] == 0.5 and metrics["policy_time"] == 1.5

"""setup_telemetry: the memory exporter end to end, idempotence, and telemetry off."""

from __future__ import annotations

import pytest

from sft_runtime.traces.setup import _signal_endpoint
from sft_runtime.traces.step_trace import SECONDS_BUCKETS, TOKENS_PER_SECOND_BUCKETS

ROWS = [
    {
        "loader_latency_max": 0.004,
        "policy_time": 0.3,
        "total_step_time": 0.31,
        "valid_tokens_per_second": 4000.0,
        "loss": 2.5,
        "grad_norm": 1.5,
        "lr": 1e-4,
        "valid_tokens": 1234,  # not an instrument: ignored
    },
    {"policy_time": 1.7, "total_step_time": 2.0, "loss": 2.0, "lr": 2e-4},
]


@pytest.fixture(scope="module")
def memory_run(run_scenario) -> dict:
    return run_scenario("memory", {"rows": ROWS})


def test_setup_is_idempotent(memory_run):
    assert memory_run["same_handle"]


def test_steps_are_root_traces_linked_to_the_job(memory_run):
    job_trace, job_span = memory_run["job"]
    steps = {
        s["attributes"]["step"]: s for s in memory_run["spans"] if s["name"] == "rl.sft_v2.step"
    }
    assert set(steps) == {5, 6}
    for s in steps.values():
        assert s["parent"] is None and s["trace"] != job_trace
        assert s["links"] == [job_span]
        assert s["attributes"]["sft.job.trace_id"] == job_trace
        assert s["attributes"]["attempt"] == 1
        assert s["resource"] == {"sft.role": "controller", "sft.attempt": 1}
    assert steps[5]["status"] == "UNSET" and steps[5]["events"] == []
    assert steps[6]["status"] == "ERROR" and steps[6]["events"] == ["exception"]


def test_metrics_units_buckets_and_values(memory_run):
    points = memory_run["points"]
    for name in (
        "rl.sft_v2.loader.latency.max",
        "rl.sft_v2.policy.duration",
        "rl.sft_v2.step.duration",
    ):
        assert points[name]["unit"] == "s"
        assert points[name]["bounds"] == list(SECONDS_BUCKETS)
    policy = points["rl.sft_v2.policy.duration"]
    assert policy["count"] == 2 and policy["sum"] == pytest.approx(2.0)
    # 0.3 s falls in (0.25, 0.5], 1.7 s in (1, 2.5]
    assert policy["counts"][SECONDS_BUCKETS.index(0.5)] == 1
    assert policy["counts"][SECONDS_BUCKETS.index(2.5)] == 1
    assert points["rl.sft_v2.loader.latency.max"]["count"] == 1
    tps = points["rl.sft_v2.valid_tokens_per_second"]
    assert tps["unit"] == "{token}/s" and tps["bounds"] == list(TOKENS_PER_SECOND_BUCKETS)
    assert tps["counts"][TOKENS_PER_SECOND_BUCKETS.index(5000.0)] == 1
    assert points["rl.sft_v2.loss"]["value"] == 2.0  # last value wins
    assert points["rl.sft_v2.lr"]["value"] == pytest.approx(2e-4)
    assert points["rl.sft_v2.grad_norm"]["value"] == 1.5


def test_disabled_telemetry_loads_no_sdk(run_scenario):
    out = run_scenario("disabled", {})
    assert out["sdk_modules"] == []
    assert out["recording"] == [False, False]
    assert out["carrier"] == {}
    assert out["enabled"] == [False, False, False]


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        (None, None),
        ("http://h:4318", "http://h:4318/v1/traces"),
        ("http://h:4318/", "http://h:4318/v1/traces"),
        ("http://h:4318/v1/traces", "http://h:4318/v1/traces"),
    ],
)
def test_endpoint_from_config(base, expected):
    assert _signal_endpoint(base, "v1/traces") == expected

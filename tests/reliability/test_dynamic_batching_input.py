"""Bad ``policy.dynamic_batching`` input is refused by `sft-runtime train` before Ray: exit 2,
one line naming the key, nothing written.

NeMo RL asserts that dynamic batching and sequence packing are exclusive, and a token budget
that cannot hold the longest row (rounded up to ``sequence_length_round``) would plan a
micro-batch over it at every long row.
"""

from __future__ import annotations

import pytest

from tests.support.reliability import train


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the run gets as far as starting or joining Ray."""
    from sft_runtime.runtime.launch import setup

    def refuse(*_a, **_k):
        raise AssertionError("Ray was reached: the refusal must come before it")

    monkeypatch.setattr(setup, "ensure_ray", refuse)


def _one_error(tmp_path, capsys, *overrides: str) -> str:
    run_dir = tmp_path / "run"
    rc, out = train(run_dir, tmp_path / "data", capsys, *overrides)
    assert rc == 2, out
    assert "Traceback" not in out
    assert not run_dir.exists()  # nothing written
    assert out.count("sft-runtime train: error:") == 1, out
    problems = [line for line in out.splitlines() if line.startswith("  ")]
    assert len(problems) == 1, out
    return problems[0]


def test_dynamic_batching_with_sequence_packing_is_refused(tmp_path, capsys, no_ray):
    both = ("policy.dynamic_batching.enabled=true", "policy.sequence_packing.enabled=true")
    line = _one_error(tmp_path, capsys, *both)
    assert "policy.dynamic_batching.enabled=true together with" in line
    assert "policy.sequence_packing.enabled=true" in line


def test_a_token_budget_under_the_longest_row_is_refused(tmp_path, capsys, no_ray):
    line = _one_error(
        tmp_path,
        capsys,
        "policy.dynamic_batching.enabled=true",
        "policy.dynamic_batching.train_mb_tokens=32",  # the small run's rows reach 64 tokens
    )
    assert "policy.dynamic_batching.train_mb_tokens=32 is smaller than the longest row" in line
    assert "set it to at least 64" in line

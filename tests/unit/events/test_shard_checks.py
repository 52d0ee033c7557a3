"""`verify`'s shard checks: a digest per shard per step, every shard dealt once."""

from __future__ import annotations

from types import SimpleNamespace

from sft_runtime.events.shards import check_shards


def _rec(type_: str, attempt: int, **data) -> SimpleNamespace:
    return SimpleNamespace(type=type_, attempt=attempt, data=data)


def _run(digests_at_3: list[str], shard_map: list[list[int]]) -> list[SimpleNamespace]:
    return [
        _rec("run_started", 1, logical_world_size=2),
        _rec("step_committed", 1, step=1, sample_digests=["a", "b"]),
        _rec("run_started", 2, logical_world_size=2, resumed_from_step=1),
        _rec(
            "placement_changed",
            2,
            resumed_from_step=1,
            old_world_size=2,
            new_world_size=len(shard_map),
            shards=2,
            shard_map=shard_map,
        ),
        _rec("step_committed", 2, step=2, sample_digests=["c", "d"]),
        _rec("step_committed", 2, step=3, sample_digests=digests_at_3),
    ]


def test_a_run_whose_steps_cover_every_shard_passes():
    report = check_shards(_run(["e", "f"], [[0, 1]]))
    assert report.problems == []
    assert report.steps == 3 and report.shards == {2}
    assert report.lines()[1] == "placement changed: attempt 2 at step 1: 2 -> 1 workers, " + (
        "shards [[0, 1]]"
    )


def test_a_missing_shard_digest_and_a_shard_dealt_twice_are_problems():
    report = check_shards(_run(["e"], [[0, 0]]))
    assert any("step 3 (attempt 2): 1 shard digests for 2 shards" in p for p in report.problems)
    assert any("not each of the run's 2 shards once" in p for p in report.problems)

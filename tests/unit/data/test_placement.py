"""Placement plan: one loader copy per DP lane, owners, delivery ranks and the hash."""

from __future__ import annotations

import pytest

from sft_runtime.runtime.data.placement import build_placement_plan


def test_dp_only_layout():
    plan = build_placement_plan({"data_parallel": 3})
    assert plan.logical_world_size == 3
    assert [(c.owner_rank, c.delivery_ranks) for c in plan.copies] == [
        (0, (0,)),
        (1, (1,)),
        (2, (2,)),
    ]


def test_replicated_axes_share_one_copy_per_lane():
    # rank = tp * 4 + dp * 2 + cp (row-major over the given axis order)
    plan = build_placement_plan({"tensor_parallel": 2, "data_parallel": 2, "context_parallel": 2})
    lane0, lane1 = plan.copies
    assert (lane0.logical_rank, lane0.logical_world_size) == (0, 2)
    assert lane0.owner_rank == 0 and lane0.delivery_ranks == (0, 1, 4, 5)
    assert lane1.owner_rank == 2 and lane1.delivery_ranks == (2, 3, 6, 7)
    assert plan.copy_for_logical_rank(1) is lane1
    with pytest.raises(ValueError, match="out of range"):
        plan.copy_for_logical_rank(2)
    with pytest.raises(ValueError, match="out of range"):
        plan.copy_for_logical_rank(-1)


def test_hash_is_stable_and_sensitive():
    layout = {"data_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 1}
    first = build_placement_plan(layout).placement_hash
    assert first == build_placement_plan(dict(layout)).placement_hash
    assert len(first) == 64
    others = [
        {"data_parallel": 4, "tensor_parallel": 1, "pipeline_parallel": 1},
        {"tensor_parallel": 2, "data_parallel": 2, "pipeline_parallel": 1},
        {"data_parallel": 2, "tensor_parallel": 2},
        {"data_parallel": 2, "tensor_parallel": 1, "pipeline_parallel": 2},
    ]
    hashes = {first} | {build_placement_plan(o).placement_hash for o in others}
    assert len(hashes) == 1 + len(others)


@pytest.mark.parametrize(
    ("layout", "mapper", "match"),
    [
        ({"tensor_parallel": 2}, "default", "no 'data_parallel' axis"),
        ({"data_parallel": 2, "expert_parallel": 2}, "default", "unknown sharding axis"),
        ({"data_parallel": 0}, "default", "size >= 1"),
        ({"data_parallel": 2, "tensor_parallel": 0}, "default", "size >= 1"),
        ({"data_parallel": 2}, "round_robin", "unknown topology mapper"),
        ({}, "default", "non-empty"),
    ],
)
def test_bad_layouts_are_rejected(layout, mapper, match):
    with pytest.raises(ValueError, match=match):
        build_placement_plan(layout, mapper=mapper)


def test_shards_are_dealt_in_contiguous_blocks_and_hashed_by_the_cut_not_the_workers():
    same = build_placement_plan({"data_parallel": 4})
    assert build_placement_plan({"data_parallel": 4}, shards=4) == same  # G = W: today's plan
    plans = {w: build_placement_plan({"data_parallel": w}, shards=4) for w in (1, 2, 4)}
    assert {p.placement_hash for p in plans.values()} == {same.placement_hash}
    assert plans[1].shard_map == [[0, 1, 2, 3]]
    assert plans[2].shard_map == [[0, 1], [2, 3]]
    assert plans[4].shard_map == [[0], [1], [2], [3]]
    assert plans[2].owner_ranks == [0, 1]
    assert [c.logical_world_size for c in plans[2].copies] == [4] * 4
    assert build_placement_plan({"data_parallel": 2}, shards=2).placement_hash != (
        same.placement_hash
    )
    with pytest.raises(ValueError, match=r"3 data-parallel workers do not divide .*shards=4"):
        build_placement_plan({"data_parallel": 3}, shards=4)

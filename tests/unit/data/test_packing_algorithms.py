"""What each packing algorithm packs, on small inputs worked out by hand, and its config."""

from __future__ import annotations

import random
from pathlib import Path
from typing import get_args

import pytest

from sft_runtime.runtime.config import loader_spec, validate_config
from sft_runtime.runtime.config_files.overrides import apply_override
from sft_runtime.runtime.data.config import PackingAlgorithm
from sft_runtime.runtime.data.packing import PACKING_ALGORITHMS, plan_bins
from sft_runtime.runtime.errors import UserInputError
from tests.support.small_run import small_raw

# Capacity 100. Input order 30, 50, 40, 20, 60: concatenative and FFD differ on it.
ORDERED = [30, 50, 40, 20, 60]
# Capacity 100, total 210: three rows are needed, and greedy fills two of them to the brim.
UNEVEN = [60, 40, 60, 40, 10]


def _totals(lengths: list[int], bins: list[list[int]]) -> list[int]:
    return [sum(lengths[i] for i in b) for b in bins]


def test_config_literal_and_module_list_agree():
    assert get_args(PackingAlgorithm) == PACKING_ALGORITHMS
    assert len(PACKING_ALGORITHMS) == 6


def test_concatenative_keeps_input_order():
    # 30+50 = 80; +40 would be 120, so a new row: 40+20 = 60; +60 would be 120, new row: 60.
    # The 20 would also have fit in the first row (room 20), but earlier rows are never revisited.
    assert plan_bins(ORDERED, 100, "concatenative") == [[0, 1], [2, 3], [4]]


def test_first_fit_decreasing_places_the_longest_first():
    # Order 60(4), 50(1), 40(2), 30(0), 20(3). 60 opens row 0 (room 40); 50 does not fit there,
    # opens row 1 (room 50); 40 fills row 0; 30 then 20 fill row 1. Two full rows.
    plan = plan_bins(ORDERED, 100, "first_fit_decreasing")
    assert plan == [[4, 2], [1, 0, 3]]
    assert _totals(ORDERED, plan) == [100, 100]


def test_first_fit_shuffle_depends_only_on_the_seed():
    # Eight samples of 25 tokens: any order gives two rows of four, the first four of the
    # shuffled order in row 0. So the plan is exactly the seeded shuffle, cut in half.
    lengths = [25] * 8
    for seed in (0, 1, 7):
        order = list(range(8))
        random.Random(seed).shuffle(order)
        random.seed(seed + 100)  # the global RNG plays no part
        plan = plan_bins(lengths, 100, "first_fit_shuffle", rng=random.Random(seed))
        assert plan == [order[:4], order[4:]]
    plans = {
        str(plan_bins(lengths, 100, "first_fit_shuffle", rng=random.Random(s))) for s in range(5)
    }
    assert len(plans) > 1


def test_modified_first_fit_decreasing_completes_the_large_items_bins():
    # Capacity 120: large > 60, medium (40, 60], small (20, 40], tiny <= 20.
    lengths = [30, 70, 45, 64, 24, 36, 10]
    # Large 70(1) and 64(3) open rows 0 (room 50) and 1 (room 56). Forward pass: row 0 takes
    # the largest medium that fits, 45(2) (room 5); no medium is left for row 1. Backward pass
    # over rows without a medium: row 1 takes the smallest small 24(4) plus the largest small
    # that still fits beside it in 32, which is 30(0) (36 does not): 64+24+30 = 118. Leftovers
    # 36(5), 10(6) fit in neither row (room 5 and 2): 36 opens row 2 and 10 joins it.
    plan = plan_bins(lengths, 120, "modified_first_fit_decreasing")
    assert plan == [[1, 2], [3, 4, 0], [5, 6]]
    assert _totals(lengths, plan) == [115, 118, 46]
    # Plain FFD puts the 36 next to the 64 (first row with room) and splits the small pair:
    # 70+45, 64+36+10 (10 does not fit row 0's room 5), 30+24.
    assert plan_bins(lengths, 120, "first_fit_decreasing") == [[1, 2], [3, 5, 6], [0, 4]]


def test_modified_first_fit_decreasing_respects_max_per_bin():
    lengths = [30, 70, 45, 64, 24, 36, 10]
    # Two per row: row 0 still gets its medium (70+45); row 1 has one free slot, too few for
    # a small pair. FFD of 36, 30, 24, 10: 36 joins the 64 (row 1 now full), 30 opens row 2,
    # 24 joins it (full), 10 finds every row full and opens row 3.
    plan = plan_bins(lengths, 120, "modified_first_fit_decreasing", max_per_bin=2)
    assert plan == [[1, 2], [3, 5], [0, 4], [6]]


def test_greedy_knapsack_fills_each_row_to_the_brim():
    # Longest first: 60(0), 60(2), 40(1), 40(3), 10(4). Row 0: the fullest subset is 100, and
    # of those the earliest items are kept: 60(0)+40(1). Row 1: 60(2)+40(3) = 100. Row 2: the
    # lone 10 - a nearly empty last row.
    plan = plan_bins(UNEVEN, 100, "greedy_knapsack")
    assert plan == [[0, 1], [2, 3], [4]]
    assert _totals(UNEVEN, plan) == [100, 100, 10]


def test_balanced_greedy_knapsack_evens_out_the_rows():
    # Greedy needs 3 rows, so the target is ceil(210 / 3) + delta = 70 + delta.
    # delta 0: row 0 takes the fullest subset <= 70: 60(0)+10(4) = 70; row 1: 60(2) (two 40s
    # would be 80); row 2: one 40(1). The other 40(3) goes to the lightest row with room
    # (row 2, 60 free): totals 70, 60, 80 instead of greedy's 100, 100, 10.
    plan = plan_bins(UNEVEN, 100, "balanced_greedy_knapsack")
    assert plan == [[0, 4], [2], [1, 3]]
    assert _totals(UNEVEN, plan) == [70, 60, 80]
    # delta 10, target 80: row 0 takes 40(1)+40(3) = 80, row 1 60(0)+10(4) = 70, row 2 60(2).
    plan = plan_bins(UNEVEN, 100, "balanced_greedy_knapsack", balanced_knapsack_delta=10)
    assert plan == [[1, 3], [0, 4], [2]]
    assert _totals(UNEVEN, plan) == [80, 70, 60]
    # A delta that lifts the target to the capacity is plain greedy knapsack.
    for delta in (30, 1000):
        plan = plan_bins(UNEVEN, 100, "balanced_greedy_knapsack", balanced_knapsack_delta=delta)
        assert plan == plan_bins(UNEVEN, 100, "greedy_knapsack")
    with pytest.raises(ValueError, match="balanced_knapsack_delta"):
        plan_bins(UNEVEN, 100, "balanced_greedy_knapsack", balanced_knapsack_delta=-1)


def _raw(**overrides: str) -> dict:
    raw = small_raw(Path("/tmp/run"), Path("/tmp/data"))
    apply_override(raw, "policy.sequence_packing.enabled=true")
    for key, value in overrides.items():
        apply_override(raw, f"{key}={value}")
    return raw


def test_balanced_knapsack_config_reaches_the_loader_spec():
    config = validate_config(
        _raw(
            **{
                "policy.sequence_packing.algorithm": "balanced_greedy_knapsack",
                "policy.sequence_packing.balanced_knapsack_delta": "16",
            }
        )
    )
    assert config.policy.sequence_packing.balanced_knapsack_delta == 16
    spec = loader_spec(config, logical_world_size=2)
    assert spec.packing_algorithm == "balanced_greedy_knapsack"
    assert spec.balanced_knapsack_delta == 16
    default = validate_config(_raw(**{"policy.sequence_packing.algorithm": "greedy_knapsack"}))
    assert default.policy.sequence_packing.balanced_knapsack_delta == 0


def test_packing_config_refuses_bad_values():
    with pytest.raises(UserInputError, match="policy.sequence_packing.balanced_knapsack_delta"):
        validate_config(_raw(**{"policy.sequence_packing.balanced_knapsack_delta": "-1"}))
    with pytest.raises(UserInputError, match="policy.sequence_packing.algorithm") as err:
        validate_config(_raw(**{"policy.sequence_packing.algorithm": "best_fit_decreasing"}))
    for name in PACKING_ALGORITHMS:
        assert repr(name) in str(err.value)

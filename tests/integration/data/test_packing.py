"""Packing: bin plans (all algorithms) and packed batches from a real energon loader."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sft_runtime.runtime.data.packing import PACKING_ALGORITHMS, plan_bins
from sft_runtime.runtime.data.task_encoder import encode_conversation
from sft_runtime.runtime.data.tokenizer import ByteTokenizer


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=0, max_size=40),
    capacity=st.integers(64, 160),
    cap=st.one_of(st.none(), st.integers(1, 5)),
    algorithm=st.sampled_from(PACKING_ALGORITHMS),
    seed=st.integers(0, 10),
    delta=st.integers(0, 200),
)
def test_plan_is_a_partition_within_capacity(lengths, capacity, cap, algorithm, seed, delta):
    bins = plan_bins(
        lengths,
        capacity,
        algorithm,
        max_per_bin=cap,
        rng=random.Random(seed),
        balanced_knapsack_delta=delta,
    )
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    for b in bins:
        assert b and sum(lengths[i] for i in b) <= capacity
        assert cap is None or len(b) <= cap
    if algorithm == "balanced_greedy_knapsack":
        # Balancing never costs a row over plain greedy knapsack.
        assert len(bins) <= len(plan_bins(lengths, capacity, "greedy_knapsack", max_per_bin=cap))


def test_algorithms_differ_where_they_should():
    lengths = [5, 60, 5, 60, 30, 30]
    assert plan_bins(lengths, 64, "concatenative") == [[0], [1], [2], [3], [4, 5]]
    assert plan_bins(lengths, 65, "concatenative") == [[0, 1], [2, 3], [4, 5]]
    assert plan_bins(lengths, 64, "first_fit_decreasing") == [[1], [3], [4, 5], [0, 2]]
    # First fit leaves 20 free in each bin; the knapsack fills the first bin exactly.
    lengths = [45, 35, 30, 25, 25]
    assert plan_bins(lengths, 100, "first_fit_decreasing") == [[0, 1], [2, 3, 4]]
    assert plan_bins(lengths, 100, "greedy_knapsack") == [[0, 2, 3], [1, 4]]
    assert plan_bins(lengths, 100, "greedy_knapsack", max_per_bin=2) == [[0, 1], [2, 3], [4]]
    assert plan_bins([10] * 5, 64, "concatenative", max_per_bin=2) == [[0, 1], [2, 3], [4]]
    one = plan_bins(list(range(1, 30)), 64, "first_fit_shuffle", rng=random.Random(1))
    two = plan_bins(list(range(1, 30)), 64, "first_fit_shuffle", rng=random.Random(2))
    assert one != two


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown packing algorithm"):
        plan_bins([1], 8, "best_fit")
    with pytest.raises(ValueError, match="outside"):
        plan_bins([9], 8, "concatenative")
    with pytest.raises(ValueError, match="needs an rng"):
        plan_bins([1], 8, "first_fit_shuffle")


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
def test_packed_batches_keep_every_token_once(make_loader, demo_messages, algorithm):
    capacity, cap, buffer = 160, 3, 12
    loader = make_loader(
        packing_algorithm=algorithm,
        packing_buffer_size=buffer,
        max_sequences_per_bin=cap,
        max_input_seq_length=capacity,
        shuffle_buffer_size=None,
    )
    tok = ByteTokenizer()
    keys: list[str] = []
    while len(keys) < len(demo_messages) + buffer:
        envelope = loader.load()
        batch = loader.active_batch
        assert envelope.physical_packs == batch.num_rows <= 4
        segment = 0
        for r in range(batch.num_rows):
            bounds = batch.cu_seqlens[r]
            assert len(bounds) - 1 <= cap and bounds[-1] <= capacity
            used = bounds[-1]
            assert (batch.segment_ids[r, used:] == -1).all()
            assert (batch.loss_mask[r, used:] == 0).all()
            for s, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                key = batch.source_ids[segment]
                ids, mask = encode_conversation(tok, demo_messages[key], max_length=capacity)
                assert batch.input_ids[r, start:stop].tolist() == ids
                assert batch.loss_mask[r, start:stop].tolist() == mask
                assert batch.position_ids[r, start:stop].tolist() == list(range(stop - start))
                assert (batch.segment_ids[r, start:stop] == s).all()
                assert batch.sequence_lengths[segment] == stop - start
                segment += 1
        assert segment == len(batch.source_ids)
        keys += envelope.source_ids
        loader.commit()
    # The stream repeats the data set: no sample twice before a full pass, all of it after one.
    first_pass = keys[: len(demo_messages) - buffer]
    assert len(first_pass) == len(set(first_pass))
    assert set(keys[: len(demo_messages) + buffer]) == set(demo_messages)


def test_a_buffers_rows_are_dealt_not_handed_out_longest_first(make_loader, demo_messages):
    """First-fit-decreasing opens its bins longest sample first; handed out in that order,
    a buffer's first steps would hold its long conversations and its last ones the short
    ones. The rows come shuffled instead, each row still as planned (longest first)."""
    buffer = 24
    loader = make_loader(
        packing_algorithm="first_fit_decreasing",
        packing_buffer_size=buffer,
        max_input_seq_length=160,
        shuffle_buffer_size=None,
    )
    firsts, seen = [], set()
    while len(seen) < buffer:
        loader.load()
        batch = loader.active_batch
        segment = 0
        for r in range(batch.num_rows):
            if len(seen) == buffer:  # the rows of the next buffer begin
                break
            bounds = batch.cu_seqlens[r]
            lengths = [stop - start for start, stop in zip(bounds, bounds[1:], strict=False)]
            assert lengths == sorted(lengths, reverse=True)  # the plan, within the row
            firsts.append(lengths[0])
            seen.update(batch.source_ids[segment : segment + len(lengths)])
            segment += len(lengths)
        loader.commit()
    assert len(seen) == buffer and len(firsts) > 3
    assert firsts != sorted(firsts, reverse=True), firsts


def test_dealing_spreads_long_and_short_rows_over_the_steps():
    """Over many buffers of skewed lengths, the conversations per step no longer fall or
    rise along the buffer: plan order ranks them perfectly, the dealt order hardly at all."""
    from sft_runtime.runtime.data.packing import deal

    def trend(per_step: list[int]) -> float:
        """Mean sign of later-minus-earlier over all pairs: 1 rising, -1 falling."""
        pairs = [(a, b) for i, a in enumerate(per_step) for b in per_step[i + 1 :] if a != b]
        return sum(1 if b > a else -1 for a, b in pairs) / max(len(pairs), 1)

    rng = random.Random(0)
    planned, dealt = [], []
    for seed in range(40):
        lengths = [rng.choice([8, 12, 16, 20, 120, 150]) for _ in range(96)]
        bins = plan_bins(lengths, 160, "first_fit_decreasing")
        for order, out in ((bins, planned), (deal(bins, random.Random(seed)), dealt)):
            steps = [order[i : i + 4] for i in range(0, len(order) - 3, 4)]
            out.append(trend([sum(len(b) for b in step) for step in steps]))
    assert sum(planned) / len(planned) > 0.6  # many short conversations come last
    assert abs(sum(dealt) / len(dealt)) < 0.2, dealt

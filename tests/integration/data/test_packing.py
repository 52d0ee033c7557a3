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
    """Every conversation of a step lands in one row, whole, in its own segment; a step
    holds exactly its batch of conversations (4), in rows of at most the capacity."""
    capacity, cap = 160, 3
    loader = make_loader(
        packing_algorithm=algorithm,
        max_sequences_per_bin=cap,
        max_input_seq_length=capacity,
        shuffle_buffer_size=None,
    )
    tok = ByteTokenizer()
    keys: list[str] = []
    while len(keys) < 2 * len(demo_messages):
        envelope = loader.load()
        batch = loader.active_batch
        assert len(envelope.source_ids) == 4 and envelope.physical_packs == batch.num_rows <= 4
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
    # The stream repeats the data set: no sample twice in a pass, all of it in one.
    first_pass = keys[: len(demo_messages)]
    assert len(first_pass) == len(set(first_pass)) and set(first_pass) == set(demo_messages)


@pytest.mark.parametrize("algorithm", ["first_fit_decreasing", "first_fit_shuffle"])
def test_a_packed_step_trains_on_the_unpacked_steps_conversations(make_loader, algorithm):
    """The global batch counts conversations, packed or not: step by step the packed
    stream holds the unpacked one's conversations (only laid out in fewer rows), so a
    packed run is the same run as the unpacked one."""
    plain = make_loader(max_input_seq_length=160)
    packed = make_loader(max_input_seq_length=160, packing_algorithm=algorithm)
    fewer = 0
    for _ in range(12):  # crosses two virtual epochs
        a, b = plain.load(), packed.load()
        assert sorted(a.source_ids) == sorted(b.source_ids)
        assert a.valid_tokens == b.valid_tokens
        fewer += b.physical_packs < a.physical_packs
        plain.commit()
        packed.commit()
    assert fewer > 6  # packing did pack
    assert plain.state_dict()["committed_samples"] == packed.state_dict()["committed_samples"]

"""Bin planning for sequence packing: which samples share a row.

Pure functions over sample lengths, so every algorithm is tested without energon. A plan is a
list of bins, each a list of indexes into the input; every index appears exactly once, no bin
holds more than `capacity` tokens or more than `max_per_bin` samples. Randomness (only
``first_fit_shuffle``) comes from the `random.Random` the caller passes in, which the task
encoder seeds from energon's restorable per-worker state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

PACKING_ALGORITHMS = (
    "concatenative",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "greedy_knapsack",
)


def _check(lengths: Sequence[int], capacity: int, max_per_bin: int | None) -> None:
    if capacity < 1:
        raise ValueError(f"bin capacity must be >= 1, got {capacity}")
    if max_per_bin is not None and max_per_bin < 1:
        raise ValueError(f"max_sequences_per_bin must be >= 1, got {max_per_bin}")
    for index, length in enumerate(lengths):
        if not 1 <= length <= capacity:
            raise ValueError(f"sample {index} has length {length}, outside [1, {capacity}]")


def _concatenative(lengths: Sequence[int], capacity: int, cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    used = capacity + 1
    for index, length in enumerate(lengths):
        if not bins or used + length > capacity or len(bins[-1]) >= cap:
            bins.append([])
            used = 0
        bins[-1].append(index)
        used += length
    return bins


def _first_fit(order: Sequence[int], lengths: Sequence[int], capacity: int, cap: int):
    bins: list[list[int]] = []
    room: list[int] = []
    for index in order:
        length = lengths[index]
        for b, free in enumerate(room):
            if free >= length and len(bins[b]) < cap:
                bins[b].append(index)
                room[b] -= length
                break
        else:
            bins.append([index])
            room.append(capacity - length)
    return bins


def _fullest_subset(items: list[int], lengths: Sequence[int], capacity: int) -> list[int]:
    """The subset of `items` with the largest total length <= capacity (exact subset sum).

    Bit s of ``reach`` says "sum s is reachable"; one big-integer shift per item keeps this
    fast for packing-buffer sizes, and the saved masks let us walk back to the chosen items.
    """
    limit = (1 << (capacity + 1)) - 1
    reach, history = 1, []
    for index in items:
        history.append(reach)
        reach |= (reach << lengths[index]) & limit
    total = reach.bit_length() - 1
    chosen: list[int] = []
    for position in range(len(items) - 1, -1, -1):
        if not (history[position] >> total) & 1:
            chosen.append(items[position])
            total -= lengths[items[position]]
    return chosen


def _greedy_knapsack(lengths: Sequence[int], capacity: int, cap: int | None) -> list[list[int]]:
    """Fill one bin at a time, each as full as possible (longest samples considered first).

    With a per-bin count cap the exact fill is replaced by taking the longest samples that
    still fit, which respects the cap.
    """
    remaining = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    while remaining:
        if cap is None:
            chosen = set(_fullest_subset(remaining, lengths, capacity))
        else:
            chosen, free = set(), capacity
            for index in remaining:
                if len(chosen) < cap and lengths[index] <= free:
                    chosen.add(index)
                    free -= lengths[index]
        bins.append([i for i in remaining if i in chosen])
        remaining = [i for i in remaining if i not in chosen]
    return bins


def plan_bins(
    lengths: Sequence[int],
    capacity: int,
    algorithm: str,
    *,
    max_per_bin: int | None = None,
    rng: random.Random | None = None,
) -> list[list[int]]:
    """Group sample indexes into bins of at most `capacity` tokens (see module docstring)."""
    _check(lengths, capacity, max_per_bin)
    cap = max_per_bin if max_per_bin is not None else len(lengths) or 1
    if algorithm == "concatenative":
        return _concatenative(lengths, capacity, cap)
    if algorithm == "first_fit_decreasing":
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        return _first_fit(order, lengths, capacity, cap)
    if algorithm == "first_fit_shuffle":
        if rng is None:
            raise ValueError("first_fit_shuffle needs an rng")
        order = list(range(len(lengths)))
        rng.shuffle(order)
        return _first_fit(order, lengths, capacity, cap)
    if algorithm == "greedy_knapsack":
        return _greedy_knapsack(lengths, capacity, max_per_bin)
    raise ValueError(
        f"unknown packing algorithm {algorithm!r}; expected one of {PACKING_ALGORITHMS}"
    )

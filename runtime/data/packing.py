"""Bin planning for sequence packing: which samples share a row.

Pure functions over sample lengths, so every algorithm is tested without energon. A plan is a
list of bins, each a list of indexes into the input; every index appears exactly once, no bin
holds more than `capacity` tokens or more than `max_per_bin` samples. Randomness
(``first_fit_shuffle``'s order) comes from the `random.Random` the caller passes in, which
the task encoder seeds from the step's source ids. Every other algorithm is deterministic
(ties between equal lengths go to the lower index), so a resumed run plans the same rows.

The names follow the NeMo RL reference, so its configs carry over unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

PACKING_ALGORITHMS = (
    "concatenative",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "modified_first_fit_decreasing",
    "greedy_knapsack",
    "balanced_greedy_knapsack",
)


def _check(lengths: Sequence[int], capacity: int, max_per_bin: int | None, delta: int) -> None:
    if capacity < 1:
        raise ValueError(f"bin capacity must be >= 1, got {capacity}")
    if max_per_bin is not None and max_per_bin < 1:
        raise ValueError(f"max_sequences_per_bin must be >= 1, got {max_per_bin}")
    if delta < 0:
        raise ValueError(f"balanced_knapsack_delta must be >= 0, got {delta}")
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


def _decreasing(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _first_fit(
    order: Sequence[int],
    lengths: Sequence[int],
    capacity: int,
    cap: int,
    bins: list[list[int]] | None = None,
    room: list[int] | None = None,
) -> list[list[int]]:
    """Each item into the first bin it fits, after any `bins` (with free `room`) already open."""
    bins = bins if bins is not None else []
    room = room if room is not None else [capacity - sum(lengths[i] for i in b) for b in bins]
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


def _modified_first_fit_decreasing(
    lengths: Sequence[int], capacity: int, cap: int
) -> list[list[int]]:
    """Johnson & Garey's MFFD: plain FFD, except that the bins opened by large items are first
    completed on purpose, so the room next to a long sample is not wasted on whatever came next.

    Sizes relative to the capacity C: large > C/2, medium in (C/3, C/2], small in (C/6, C/3],
    tiny <= C/6. Each large item opens its own bin (largest first). Going forward through
    those bins (least free room first), each gets the largest medium item that fits. Going
    backward (most free room first), each bin still without a medium gets a pair of small
    items: the smallest one plus the largest one that fits beside it, when the two smallest
    fit together. Everything left is first-fit-decreasing, into these bins first, then new ones.
    Its edge over FFD is the worst case (71/60 of the optimal row count against 11/9); on a
    given buffer it may use a row more or fewer than FFD.
    """
    order = _decreasing(lengths)
    large = [i for i in order if 2 * lengths[i] > capacity]
    medium = [i for i in order if 3 * lengths[i] > capacity >= 2 * lengths[i]]
    small = [i for i in order if 6 * lengths[i] > capacity >= 3 * lengths[i]]
    bins = [[i] for i in large]
    room = [capacity - lengths[i] for i in large]
    with_medium = [False] * len(bins)
    for b in range(len(bins)):
        # `medium` is longest first, so the first one that fits is the largest that fits.
        pick = next((i for i in medium if lengths[i] <= room[b]), None)
        if pick is None or len(bins[b]) >= cap:
            continue
        medium.remove(pick)
        bins[b].append(pick)
        room[b] -= lengths[pick]
        with_medium[b] = True
    for b in reversed(range(len(bins))):
        if with_medium[b] or len(small) < 2 or cap - len(bins[b]) < 2:
            continue
        first = min(small, key=lambda i: (lengths[i], i))
        rest = [i for i in small if i != first]
        second = min(rest, key=lambda i: (lengths[i], i))
        if lengths[first] + lengths[second] > room[b]:
            continue
        partner = next(i for i in rest if lengths[i] <= room[b] - lengths[first])
        for index in (first, partner):
            small.remove(index)
            bins[b].append(index)
            room[b] -= lengths[index]
    placed = {i for b in bins for i in b}
    leftovers = [i for i in order if i not in placed]
    return _first_fit(leftovers, lengths, capacity, cap, bins, room)


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


def _fill(remaining: list[int], lengths: Sequence[int], limit: int, cap: int | None) -> set[int]:
    """The samples for one bin of at most `limit` tokens, as full as possible.

    With a per-bin count cap the exact fill is replaced by taking the longest samples that
    still fit, which respects the cap. `remaining` must be longest first.
    """
    if cap is None:
        return set(_fullest_subset(remaining, lengths, limit))
    chosen: set[int] = set()
    free = limit
    for index in remaining:
        if len(chosen) < cap and lengths[index] <= free:
            chosen.add(index)
            free -= lengths[index]
    return chosen


def _greedy_knapsack(lengths: Sequence[int], capacity: int, cap: int | None) -> list[list[int]]:
    """Fill one bin at a time, each as full as possible (longest samples considered first)."""
    remaining = _decreasing(lengths)
    bins: list[list[int]] = []
    while remaining:
        chosen = _fill(remaining, lengths, capacity, cap)
        bins.append([i for i in remaining if i in chosen])
        remaining = [i for i in remaining if i not in chosen]
    return bins


def _balanced_greedy_knapsack(
    lengths: Sequence[int], capacity: int, cap: int | None, delta: int
) -> list[list[int]]:
    """Greedy knapsack aimed at rows of even token totals rather than full front rows.

    Rows of one batch cost compute in proportion to their tokens, so a plan of full rows plus
    a nearly empty last one makes the micro-batches (and data-parallel ranks) that get the
    full rows the stragglers. This keeps greedy_knapsack's row count n (at least
    ceil(total / capacity); the count greedy_knapsack reached is a packing known to exist) and
    aims every row at ``target = ceil(total / n) + delta``: each row in turn is filled as full
    as possible up to ``min(capacity, target)``. Samples left over then go, longest first, to
    the lightest row that still has room for them within the capacity, and a new row is opened
    only for a sample that fits nowhere.

    ``delta`` is how many tokens over the mean a row may take while filling: 0 balances
    hardest; a larger delta lets the early rows fill up and, from ``delta >= capacity`` on, the
    plan is exactly greedy_knapsack's. Should balancing ever need more rows than
    greedy_knapsack, greedy_knapsack's plan is returned: balance never costs an extra row.
    """
    greedy = _greedy_knapsack(lengths, capacity, cap)
    if not greedy:
        return greedy
    target = -(-sum(lengths) // len(greedy)) + delta
    limit = min(capacity, target)
    remaining = _decreasing(lengths)
    bins: list[list[int]] = []
    for _ in greedy:
        chosen = _fill(remaining, lengths, limit, cap)
        bins.append([i for i in remaining if i in chosen])
        remaining = [i for i in remaining if i not in chosen]
    room = [capacity - sum(lengths[i] for i in b) for b in bins]
    for index in remaining:
        fits = [
            b
            for b in range(len(bins))
            if room[b] >= lengths[index] and (cap is None or len(bins[b]) < cap)
        ]
        if fits:
            b = max(fits, key=lambda b: (room[b], -b))
        else:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(index)
        room[b] -= lengths[index]
    bins = [b for b in bins if b]
    return bins if len(bins) <= len(greedy) else greedy


def plan_bins(
    lengths: Sequence[int],
    capacity: int,
    algorithm: str,
    *,
    max_per_bin: int | None = None,
    rng: random.Random | None = None,
    balanced_knapsack_delta: int = 0,
) -> list[list[int]]:
    """Group sample indexes into bins of at most `capacity` tokens (see module docstring).

    `balanced_knapsack_delta` only affects ``balanced_greedy_knapsack`` (see
    `_balanced_greedy_knapsack`); `rng` only ``first_fit_shuffle``, which requires it.
    """
    _check(lengths, capacity, max_per_bin, balanced_knapsack_delta)
    cap = max_per_bin if max_per_bin is not None else len(lengths) or 1
    if algorithm == "concatenative":
        return _concatenative(lengths, capacity, cap)
    if algorithm == "first_fit_decreasing":
        return _first_fit(_decreasing(lengths), lengths, capacity, cap)
    if algorithm == "first_fit_shuffle":
        if rng is None:
            raise ValueError("first_fit_shuffle needs an rng")
        order = list(range(len(lengths)))
        rng.shuffle(order)
        return _first_fit(order, lengths, capacity, cap)
    if algorithm == "modified_first_fit_decreasing":
        return _modified_first_fit_decreasing(lengths, capacity, cap)
    if algorithm == "greedy_knapsack":
        return _greedy_knapsack(lengths, capacity, max_per_bin)
    if algorithm == "balanced_greedy_knapsack":
        return _balanced_greedy_knapsack(lengths, capacity, max_per_bin, balanced_knapsack_delta)
    raise ValueError(
        f"unknown packing algorithm {algorithm!r}; expected one of {PACKING_ALGORITHMS}"
    )

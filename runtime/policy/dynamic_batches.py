"""NeMo RL's dynamic batching: a rank's rows split into micro-batches by a token budget.

With ``policy.dynamic_batching.enabled`` a micro-batch is not ``train_micro_batch_size``
rows but as many rows as fit ``train_mb_tokens``, counting a micro-batch as it is padded:
its rows times its longest row rounded up to ``sequence_length_round``. As in NeMo RL the
rows are sorted by length first, so short rows share micro-batches and long ones go alone.

The plan is a pure function of the rows' lengths (ties go by index), so the same batch is
always split the same way and a resumed run repeats its steps bit for bit. The loss is a
per-token mean over the step's global supervised tokens whatever the split, so a split
changes the loss only by float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def padded_length(length: int, round_to: int) -> int:
    """The columns a row of ``length`` tokens takes in a micro-batch (an empty row counts
    one token, as `SFTBatch.trimmed` keeps one column)."""
    return round_up(max(length, 1), round_to)


def token_budget_micro_batches(
    lengths: Sequence[int], budget: int, round_to: int = 1
) -> list[list[int]]:
    """The rows (indexes into ``lengths``) of each micro-batch, shortest rows first.

    Rows are taken in order of length (ties by index) and a micro-batch grows while its rows
    times its longest row's `padded_length` stays within ``budget``. A row over the budget
    by itself forms a micro-batch alone. Every index appears exactly once, and each
    micro-batch's indexes follow on from the previous one's in that sorted order.
    """
    if budget < 1 or round_to < 1:
        raise ValueError(f"budget ({budget}) and round_to ({round_to}) must be positive")
    if any(n < 0 for n in lengths):
        raise ValueError(f"row lengths must not be negative, got {list(lengths)}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = padded_length(lengths[i], round_to)  # the longest so far: rows come sorted
        if current and (len(current) + 1) * width > budget:
            plan.append(current)
            current = []
        current.append(i)
    if current:
        plan.append(current)
    return plan

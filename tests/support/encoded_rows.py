"""Encoded rows of given lengths with random token ids, for tests of how a batch is cut into
micro-batches (the first half of each row is context, the rest supervised)."""

from __future__ import annotations

import random

from sft_runtime.runtime.data.task_encoder import EncodedChat


def random_rows(lengths: list[int], vocab: int, seed: int = 0) -> list[EncodedChat]:
    rng = random.Random(seed)
    rows = []
    for index, length in enumerate(lengths):
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        mask = [0.0] * (length // 2) + [1.0] * (length - length // 2)
        rows.append(
            EncodedChat(
                __key__=f"s{index}",
                __restore_key__=(),
                __subflavors__=None,
                __sources__=(),
                source_ids=[f"s{index}"],
                token_ids=[ids],
                loss_masks=[mask],
            )
        )
    return rows

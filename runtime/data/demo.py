"""A small deterministic synthetic chat data set for the demo, tests and benchmarks.

Conversations are arithmetic questions, echo/reverse requests and short multi-turn chats with
an optional system prompt, so lengths vary (from about 20 to a few hundred bytes) and every
kind of turn the task encoder handles appears. The same `seed` always gives the same files.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from sft_runtime.runtime.data.prepare import (
    energon_prepare,
    ensure_empty_out_dir,
    sample_key,
    write_shards,
)

_WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega"
).split()
_SYSTEM = "You are a careful assistant. Answer briefly."


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def demo_conversation(rng: random.Random) -> list[dict[str, str]]:
    """One synthetic conversation drawn from `rng`."""
    kind = rng.randrange(4)
    messages: list[dict[str, str]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _SYSTEM})
    if kind == 0:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        messages += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}"},
        ]
    elif kind == 1:
        text = _words(rng, 1, 12)
        messages += [
            {"role": "user", "content": f"Echo: {text}"},
            {"role": "assistant", "content": text},
        ]
    elif kind == 2:
        text = _words(rng, 1, 8)
        messages += [
            {"role": "user", "content": f"Reverse the words: {text}"},
            {"role": "assistant", "content": " ".join(reversed(text.split()))},
        ]
    else:
        for _ in range(rng.randint(2, 4)):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            messages += [
                {"role": "user", "content": f"Multiply {a} by {b}."},
                {"role": "assistant", "content": f"{a * b}"},
            ]
    return messages


def build_demo_dataset(
    out_dir: Path | str, num_samples: int = 512, seed: int = 0, val_samples: int = 0
) -> Path:
    """Write `num_samples` synthetic conversations as a prepared energon data set in `out_dir`,
    and `val_samples` more as its ``val`` split."""
    out_dir = Path(out_dir)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    ensure_empty_out_dir(out_dir)
    rng = random.Random(seed)

    def samples() -> Iterator[tuple[str, str, list[dict[str, str]]]]:
        for index in range(num_samples):
            yield "train", sample_key(index + 1), demo_conversation(rng)
        for index in range(num_samples, num_samples + val_samples):
            yield "val", sample_key(index + 1), demo_conversation(rng)

    write_shards(out_dir, samples(), shard_size=max(1, -(-num_samples // 4)))
    energon_prepare(out_dir, ["train", "val"] if val_samples else ["train"])
    return out_dir

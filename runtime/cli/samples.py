"""`samples RUN_DIR --step N [--rank R] [--json]`: what step N trained on, per logical rank.

The loaders are restored from the newest checkpoint before N and read forward; every batch
on the way must match the log's sample digest for its step and rank (`runtime.debug.samples`).
Exit 0 with the samples; 1 when the rebuilt loader gives other samples than the log
recorded (the data set or the loader changed since the run: the error names the step and
the rank, and no samples are shown); 2 for bad input (no checkpoint before N, N beyond
the log, a damaged log or checkpoint, a config this code no longer accepts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_MISMATCH = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("samples", help="the source samples of step N, proven by the log")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, required=True, help="the step to show")
    p.add_argument("--rank", type=int, default=None, help="one logical rank only")
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="look for the checkpoints here (default: where the log records them)",
    )
    p.add_argument("--json", action="store_true", help="print JSON: one object per rank")
    p.set_defaults(func=cmd_samples)


def cmd_samples(args: argparse.Namespace) -> int:
    from sft_runtime.runtime.debug.samples import SampleMismatchError, step_samples

    try:
        found = step_samples(
            args.run_dir,
            args.step,
            ranks=None if args.rank is None else [args.rank],
            checkpoint_dir=args.checkpoint_dir,
        )
    except SampleMismatchError as exc:
        print(f"sft-runtime samples: mismatch: {exc}", file=sys.stderr)
        return EXIT_MISMATCH
    if args.json:
        rows = [
            {
                "step": args.step,
                "rank": rank.rank,
                "checkpoint": found.start.checkpoint,
                "digest": rank.digest,
                "samples": [s.to_json() for s in rank.samples],
            }
            for rank in found.ranks
        ]
        print(json.dumps(rows))
        return 0
    start = found.start
    print(
        f"step {args.step} of {start.run_dir}: loaders started from {start.origin} "
        f"and read through steps {start.checkpoint + 1}..{args.step}; every batch matches "
        "the log's sample digests"
    )
    print("supervised tokens (the loss was taken on them) are shown [[like this]]")
    for rank in found.ranks:
        print(f"\nlogical rank {rank.rank}: {len(rank.samples)} samples, digest {rank.digest}")
        for sample in rank.samples:
            print(
                f"  {sample.source_id}  {sample.tokens} tokens, "
                f"{sample.supervised_tokens} supervised"
            )
            for line in sample.text.splitlines() or [""]:
                print(f"    {line}")
    return 0

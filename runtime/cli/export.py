"""`export`: a checkpoint of a Hugging Face run as one standalone model folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face model folder (from_pretrained)"
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path, help="the model folder to create (new or empty)")
    p.add_argument("--step", type=int, default=None, help="default: the newest checkpoint")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast the weights (default: as saved, float32)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest weights file (5GB, 500MB, 2GiB; default 5GB, as save_pretrained)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write its base with the adapters merged (default: peft's adapter folder)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="look for the checkpoints here (default: where the log records them)",
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from sft_runtime.runtime.export.hf_export import export_checkpoint
    from sft_runtime.runtime.launch.run_dirs import require_run_dir

    if args.checkpoint_dir is None or args.run_dir.exists():  # its checkpoints may lie elsewhere
        require_run_dir(args.run_dir)
    export_checkpoint(
        args.run_dir,
        args.out,
        step=args.step,
        dtype=args.dtype,
        checkpoint_dir=args.checkpoint_dir,
        max_shard_size=args.max_shard_size,
        merge=args.merge,
        progress=lambda line: print(line, file=sys.stderr),
    )
    print(args.out)
    return 0

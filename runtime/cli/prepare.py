"""The ``prepare-data`` and ``demo-data`` subcommands.

`register` plugs them into the runtime's argparse CLI; `main` runs them alone (tests, scripts).
Bad input is one clear line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sft_runtime.runtime.errors import UserInputError


def _run_prepare(args: argparse.Namespace) -> int:
    from sft_runtime.runtime.data.prepare import prepare_jsonl

    try:
        result = prepare_jsonl(
            args.input,
            args.out_dir,
            shard_size=args.shard_size,
            val_fraction=args.val_fraction,
            skip_bad=args.skip_bad,
            seed=args.seed,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
        )
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {result.num_train} train and {result.num_val} val samples in "
        f"{result.num_shards} shard(s) to {result.out_dir}"
    )
    if args.tokenizer is not None:
        print(f"every sample renders under the chat template of {args.tokenizer}")
    if args.skip_bad:
        lines = result.skipped_lines
        shown = ", ".join(map(str, lines[:10])) + (" ..." if len(lines) > 10 else "")
        print(f"skipped {len(lines)} bad line(s)" + (f": {shown}" if lines else ""))
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from sft_runtime.runtime.data.demo import build_demo_dataset

    try:
        path = build_demo_dataset(args.out_dir, num_samples=args.num_samples, seed=args.seed)
    except (UserInputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.num_samples} demo conversations to {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``prepare-data`` and ``demo-data`` to the CLI's subcommands."""
    prep = subparsers.add_parser(
        "prepare-data",
        help="turn JSONL conversations into an energon data set",
        description="Validate every line of INPUT.jsonl ({'messages': [...]} or "
        "{'prompt', 'response'}) and write an energon data set to OUT_DIR. With --tokenizer, "
        "every conversation is also rendered by that tokenizer's chat template, as training "
        "renders it, and a line the template refuses is a bad line.",
    )
    prep.add_argument("input", metavar="INPUT.jsonl")
    prep.add_argument("out_dir", metavar="OUT_DIR")
    prep.add_argument("--shard-size", type=int, default=1000, help="samples per tar shard")
    prep.add_argument(
        "--val-fraction", type=float, default=0.0, help="fraction of samples for the val split"
    )
    prep.add_argument(
        "--skip-bad", action="store_true", help="skip invalid lines instead of failing"
    )
    prep.add_argument("--seed", type=int, default=0, help="seed of the train/val assignment")
    prep.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="Hugging Face tokenizer folder (usually the model's) whose chat template must "
        "render every conversation",
    )
    prep.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja file that replaces the tokenizer's chat template "
        "(as policy.tokenizer.chat_template does in training)",
    )
    prep.set_defaults(func=_run_prepare)

    demo = subparsers.add_parser(
        "demo-data", help="write a small synthetic chat data set (energon format)"
    )
    demo.add_argument("out_dir", metavar="OUT_DIR")
    demo.add_argument("--num-samples", type=int, default=512)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_run_demo)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one of the two subcommands without the rest of the runtime's CLI."""
    parser = argparse.ArgumentParser(prog="sft-runtime")
    register(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return int(exc.code or 0)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

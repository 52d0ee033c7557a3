"""The `sft-runtime` command. Subcommands import their heavy modules only when they run.

Exit codes: 0 success, 1 run failure (or a verification that found a difference),
2 bad input (config, arguments, damaged files).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sft_runtime.events.errors import EventLogError
from sft_runtime.runtime.cli.train import is_override
from sft_runtime.runtime.errors import RunFailure, UserInputError
from sft_runtime.runtime.process.disk_full import disk_full_error

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2
_DATA_COMMANDS = ("prepare-data", "demo-data")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sft-runtime", description="Event-sourced SFT runtime on Ray."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from sft_runtime.runtime.cli import inspect as inspect_cli

    inspect_cli.register(sub)
    from sft_runtime.runtime.cli import diff as diff_cli
    from sft_runtime.runtime.cli import export as export_cli
    from sft_runtime.runtime.cli import trace as trace_cli
    from sft_runtime.runtime.cli import train as train_cli

    train_cli.register(sub)
    trace_cli.register(sub)
    export_cli.register(sub)
    diff_cli.register(sub)
    from sft_runtime.runtime.cli import reproduce as reproduce_cli
    from sft_runtime.runtime.cli import samples as samples_cli

    samples_cli.register(sub)
    reproduce_cli.register(sub)
    from sft_runtime.runtime.cli import fetch_model as fetch_model_cli

    fetch_model_cli.register(sub)
    if any(arg in _DATA_COMMANDS for arg in argv):
        from sft_runtime.runtime.cli import (
            prepare as prepare_cli,  # pulls in energon and torch: only when asked
        )

        prepare_cli.register(sub)
    else:
        for name in _DATA_COMMANDS:
            sub.add_parser(name, help="prepare an energon data set (see --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)  # bad arguments: argparse exits with 2
    if extra:
        # `train CONFIG --run-dir D key=value`: overrides may come after the options too
        if getattr(args, "overrides", None) is not None and all(map(is_override, extra)):
            args.overrides += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except (UserInputError, EventLogError) as exc:
        print(f"sft-runtime {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunFailure as exc:  # a diverged step, a full disk: its one line explains it
        print(f"sft-runtime {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"sft-runtime {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a full disk under another error (a driver-side write, Ray's)
        full = disk_full_error(exc)
        if full is None:
            raise
        print(f"sft-runtime {args.command}: error: {full}", file=sys.stderr)
        return EXIT_FAILURE


def console() -> None:
    """The `sft-runtime` console script: `main`, then an exit that skips the interpreter's
    teardown (see runtime/process/exit_now.py)."""
    from sft_runtime.runtime.process.exit_now import exit_now

    exit_now(main())


if __name__ == "__main__":
    console()

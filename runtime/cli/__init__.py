"""The `sft-runtime` command, one module per command group; `main` is the console script."""

from sft_runtime.runtime.cli.main import main

__all__ = ["main"]

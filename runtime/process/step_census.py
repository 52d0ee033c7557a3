"""Which of this project's files run during one training step, in each process.

Off unless ``SFT_RUNTIME_STEP_CENSUS=STEP:DIR``. The controller (around step STEP) and each
worker (around its call that trains step STEP, which also commits the batch of the step
before) then record every function called in their thread whose code is one of this
package's files, and write ``DIR/<role>.json``: those files, relative to the package. It is
how `bench/step_files.py` counts the files a reader must follow to understand one step; the
driver hands the variable to the actors as it hands them the fault variables.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV = "SFT_RUNTIME_STEP_CENSUS"
ROOT = Path(__file__).resolve().parents[2]  # the package: runtime/process/ is two below it


@contextmanager
def step_census(role: str, step: int) -> Iterator[None]:
    """Record the package's files that run in this thread while the block runs, when the
    variable names ``step``; otherwise nothing happens."""
    want, _, out = os.environ.get(ENV, "").partition(":")
    if not want or int(want) != step:
        yield
        return
    root = str(ROOT) + os.sep
    skip = (os.path.join(root, ".venv"), __file__)  # a venv inside the checkout; this file
    seen: set[tuple[str, str]] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            name = code.co_filename
            if name.startswith(root) and not name.startswith(skip) and "site-packages" not in name:
                seen.add((name, code.co_qualname))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)
        functions = sorted(f"{os.path.relpath(name, ROOT)}:{qual}" for name, qual in seen)
        files = sorted({entry.partition(":")[0] for entry in functions})
        Path(out).mkdir(parents=True, exist_ok=True)
        record = {"step": step, "files": files, "functions": functions}
        Path(out, f"{role}.json").write_text(json.dumps(record))

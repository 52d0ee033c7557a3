"""`make bench`: run every benchmark in bench/, print one table, write bench/RESULTS.md.

Each benchmark module exposes ``run() -> list[dict]`` of rows measured side by side with
their reference in the same run; this script only gathers and prints them.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # energon's buffer-filling progress bars
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.table import render  # noqa: E402

BENCHMARKS = ["events", "loader", "policy", "tracing", "step"]


def main() -> int:
    sections, failed = [], []
    for name in BENCHMARKS:
        if not (ROOT / "bench" / f"{name}.py").exists():
            continue
        print(f"== bench/{name}.py", flush=True)
        try:
            rows = importlib.import_module(f"bench.{name}").run()
        except Exception:  # one broken benchmark must not hide the others
            traceback.print_exc()
            failed.append(name)
            continue
        table = render(rows)
        print(table, flush=True)
        sections.append(f"## bench/{name}.py\n\n```\n{table}\n```\n")
    header = (
        f"# Benchmark results\n\nDate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  \n"
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, "
        f"Python {platform.python_version()}  \nCommand: `make bench`\n\n"
        "Ratios compare figures measured side by side in the same run.\n\n"
    )
    (ROOT / "bench" / "RESULTS.md").write_text(header + "\n".join(sections))
    if failed:
        print(f"benchmarks that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

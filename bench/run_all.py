"""`make bench`: run every benchmark in bench/, print one table, write bench/RESULTS.md.

Each benchmark module exposes ``run() -> list[dict]`` of rows measured side by side with
their reference in the same run; this script only gathers and prints them. Each runs in a
fresh Python process, so what one leaves behind (a 1 GB heap, a global tracer provider, page
cache being written back) does not weigh on the next.

``--smoke`` runs every benchmark through the same code with tiny sizes, few steps and one
round (`bench.harness.SMOKE`, set for the children through the environment), to show that
each still runs and prints its rows; its figures mean nothing, so bench/RESULTS.md is left
alone, and it saves the machine's time where only figures would suffer: it starts one Ray
here that the benchmarks and the `sft-runtime train` runs they launch join
(`bench.harness.shared_ray`; a Ray start is seconds of CPU, and there would be a dozen),
runs two benchmarks at a time, gives every process one torch thread
(`bench.harness.SMOKE_THREADS_ENV`), and forks each Python process it and the benchmarks
start (the benchmark, its plain loops, its children, its `sft-runtime` launches) from one
that has imported torch, transformers, Ray and the runtime already (`bench/zygote.py`;
about 3 core-s of imports a process here). Either way the exit status is 1 when a
benchmark failed or gave no rows.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")  # energon's buffer-filling progress bars
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness, zygote  # noqa: E402
from bench.table import render  # noqa: E402

BENCHMARKS = [
    "events",
    "loader",
    "elastic",
    "policy",
    "tracing",
    "overhead",
    "hf_step",
    "packed_attention",
    "prefetch",
    "scaling",
    "resume",
    "load_memory",
    "lora",
    "hf_start_readers",
    "shutdown",
    "real_model",
    "run_tree",
    "step_files",
]
# smoke seconds of the longest benchmarks (run_all --smoke, 2 lanes, 2 cores): started first
# so that two lanes end together rather than one running the last long one alone
SMOKE_SECONDS = {
    "hf_step": 35,
    "run_tree": 26,
    "load_memory": 23,
    "resume": 16,
    "overhead": 13,
    "shutdown": 13,
    "real_model": 12,
    "prefetch": 11,
    "hf_start_readers": 10,
    "step_files": 7,
    "scaling": 7,
}
MARK = "bench-rows: "
# Smoke figures mean nothing, so two benchmarks may share the machine: a good part of each
# is one process starting up (imports, a Ray actor) while the other core has nothing to do.
SMOKE_LANES = 2


def main(smoke: bool = False) -> int:
    smoke = smoke or harness.SMOKE
    if smoke:
        os.environ[harness.SMOKE_ENV] = "1"  # read by bench.harness in each child
        os.environ.update(harness.SMOKE_THREADS_ENV)  # one torch thread a process
        with (
            tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp,
            harness.shared_ray(Path(tmp)),
            zygote.serving(Path(tmp)),
        ):
            _, failed = run_each(SMOKE_LANES)
    else:
        sections, failed = run_each()
        header = (
            f"# Benchmark results\n\n"
            f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  \n"
            f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, "
            f"Python {platform.python_version()}  \nCommit: {_commit()}  \n"
            "Command: `make bench`\n\n"
            "Ratios compare figures measured side by side in the same run.\n\n"
        )
        (ROOT / "bench" / "RESULTS.md").write_text(header + "\n".join(sections))
    if failed:
        print(f"benchmarks that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _commit() -> str:
    """The commit the benchmarks ran on, marked when the tree held changes not committed."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} (with changes not committed)" if dirty else head


def run_each(lanes: int = 1) -> tuple[list[str], list[str]]:
    """Every benchmark in a process of its own, ``lanes`` of them at a time, each table
    printed in the order of BENCHMARKS; (the RESULTS.md sections, the names of those that
    failed)."""
    names = [name for name in BENCHMARKS if (ROOT / "bench" / f"{name}.py").exists()]
    sections, failed = [], []
    with ThreadPoolExecutor(lanes) as pool:
        ahead: dict[str, Any] = {}
        if lanes > 1:
            for name in sorted(names, key=lambda n: -SMOKE_SECONDS.get(n, 0)):
                ahead[name] = pool.submit(_child, name)
        for name in names:
            print(f"== bench/{name}.py", flush=True)
            done, took = ahead[name].result() if ahead else _child(name)
            marked = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
            rows = json.loads(marked[-1][len(MARK) :]) if marked else []
            if done.returncode or not rows:  # one broken benchmark must not hide the others
                why = f"exit code {done.returncode}" if done.returncode else "no rows"
                print(f"bench/{name}.py failed ({why}) after {took:.1f} s", flush=True)
                failed.append(name)
                continue
            table = render(rows)
            print(table, flush=True)
            print(f"bench/{name}.py took {took:.1f} s", flush=True)
            sections.append(f"## bench/{name}.py\n\n```\n{table}\n```\n")
    return sections, failed


def _child(name: str) -> tuple[subprocess.CompletedProcess, float]:
    """One benchmark in a process of its own (`one`), and its wall seconds."""
    start = time.monotonic()
    done = zygote.run([sys.executable, __file__, "--one", name], stdout=subprocess.PIPE, text=True)
    return done, time.monotonic() - start


def one(name: str) -> int:
    """Run one benchmark here; its rows as one JSON line on stdout after ``MARK``."""
    try:
        rows = importlib.import_module(f"bench.{name}").run()
    except Exception:
        traceback.print_exc()
        return 1
    print(MARK + json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        sys.exit(one(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, few steps, one round: check that every benchmark runs (no RESULTS.md)",
    )
    sys.exit(main(smoke=parser.parse_args().smoke))

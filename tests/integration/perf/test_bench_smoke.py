"""Every benchmark in bench/ still runs: `make bench`'s own script in smoke mode (tiny sizes,
few steps), so a moved file or a changed API breaks this test rather than `make bench`.

What is checked is that each benchmark ran to the end and printed its rows, never a time,
and left nothing in its temporary directory.
The GPU benchmark's CPU smoke run goes alongside `make bench`'s: both spend much of their
time starting processes, which leaves a core idle now and then.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.run_all import BENCHMARKS  # noqa: E402
from tests.support.temp_root import fresh_temp_dir, left_behind  # noqa: E402

# bench/ modules that are not benchmarks of `make bench`, each with why
NOT_BENCHMARKS = {
    "__init__",
    "harness",  # shared helpers
    "cli_runs",  # `sft-runtime` launched as a user launches it
    "cpu_share",  # CPU per step of a run's processes
    "timeline",  # where a worker's step goes, read from a run's spans
    "table",  # the row and its table
    "plain_loop",  # the reference loop the benchmarks run
    "real_model_sides",  # the three trainers bench/real_model.py runs side by side
    "interleave",  # the in-turns runner of hf_step
    "run_all",  # this runner
    "zygote",  # smoke mode's Python processes, forked from one that imported the stack
    "same_run",  # two revisions' runs compared bit for bit, nothing measured
    "gpu_hf",  # needs a GPU for its figures; its CPU smoke mode is run below
    "scale_plan",  # a calculator of the 70B plan (docs/scale.md), nothing measured
}


def _env(tmp: Path) -> dict[str, str]:
    """The test's environment, less what would join another Ray or collector, with its own
    temporary directory ``tmp`` (what a benchmark forgets there is seen)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "OTEL_"))}
    env.update(RAY_AUTH_MODE="disabled", TMPDIR=str(tmp))
    return env


@pytest.fixture(scope="module")
def gpu_smoke(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """`bench/gpu_hf.py --smoke`, started once: (its process, the file its output goes to, its
    temporary directory)."""
    out = tmp_path_factory.mktemp("gpu-hf-smoke") / "output.txt"
    with fresh_temp_dir("sftgpu-") as tmp, open(out, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "bench/gpu_hf.py", "--smoke"],
            cwd=ROOT,
            env=_env(tmp),
            stdout=fh,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            yield proc, out, tmp
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_every_bench_module_is_a_benchmark_of_make_bench_or_named_as_not():
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert modules - NOT_BENCHMARKS == set(BENCHMARKS)


def test_make_bench_runs_every_benchmark_in_smoke_mode_and_leaves_results_alone(gpu_smoke):
    # gpu_smoke: started first, so that it runs beside this one
    results = ROOT / "bench" / "RESULTS.md"
    before = results.read_bytes()
    with fresh_temp_dir("sftb-") as tmp:  # short: Ray's socket paths are made under it
        done = subprocess.run(
            [sys.executable, "bench/run_all.py", "--smoke"],
            cwd=ROOT,
            env=_env(tmp),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        left = left_behind(tmp)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    for name in BENCHMARKS:
        section = out.split(f"== bench/{name}.py\n", 1)
        assert len(section) == 2, f"bench/{name}.py did not run"
        table = section[1].split("\n== bench/", 1)[0]
        assert "figure" in table.splitlines()[0], f"bench/{name}.py printed no table"
        assert f"bench/{name}.py took" in table, table
    assert results.read_bytes() == before, "a smoke run must not overwrite bench/RESULTS.md"
    assert left == [], "the benchmarks left files in their temporary directory"


def test_the_gpu_benchmark_runs_on_cpu_in_smoke_mode(gpu_smoke):
    proc, out, tmp = gpu_smoke
    code = proc.wait(timeout=900)
    text = out.read_text()
    assert code == 0, text[-8000:]
    for side in ("plain FSDP2 loop", "sft-runtime", "ratio sft-runtime / plain"):
        assert side in text, text[-8000:]
    assert left_behind(tmp) == []  # its work folder (a 1B model on a GPU) is gone

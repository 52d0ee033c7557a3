"""How many of the project's files one steady-state training step runs, in each process.

A toy run on two workers (no save, no validation near the step) with the step census on
(`runtime/process/step_census.py`): the controller records the files whose functions run
while it drives step ``CENSUS_STEP`` (send, wait, metrics, commit, record, and the next
step sent ahead), each worker those of its call that trains that step (the previous
batch's commit, the load, forward/backward, all-reduce, optimizer). The figure is the
union over the processes, the way a reader counts the files to follow for one step.
Target: at most 20.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402

CENSUS_STEP = 4  # past the first steps (the pipeline is full), no save near it
TARGET = 20


FUNCTIONS_ENV = "SFT_STEP_FILES_FUNCTIONS"  # set: list each file's functions that ran too


def census(data: Path, tmp: Path) -> dict[str, dict[str, list[str]]]:
    """role -> the files and the functions (``file:qualname``) of one run's step
    ``CENSUS_STEP``."""
    from sft_runtime.runtime.process.step_census import ENV

    out = tmp / "census"
    raw = h.raw_config(h.COMPUTE, data, tmp / "run", CENSUS_STEP + 2)
    raw["checkpointing"]["save_period"] = 1000  # only the final save, two steps later
    raw["telemetry"] = {"enabled": False}
    os.environ[ENV] = f"{CENSUS_STEP}:{out}"
    try:
        h.runtime_run(raw)
    finally:
        del os.environ[ENV]
    found = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    if "controller" not in found or not any(r.startswith("worker") for r in found):
        raise RuntimeError(f"the census wrote {sorted(found)}: a process did not record")
    return found


def run() -> list[dict]:
    with h.workspace() as (data, tmp):
        found = census(data, tmp)
    controller = set(found["controller"]["files"])
    workers = {f for k, v in found.items() if k.startswith("worker") for f in v["files"]}
    functions = {f for v in found.values() for f in v["functions"]}
    union = controller | workers
    print("files of one step (c: controller, w: workers):", file=sys.stderr)
    for name in sorted(union):
        where = ("c" if name in controller else " ") + ("w" if name in workers else " ")
        print(f"  {where} {name}", file=sys.stderr)
        if os.environ.get(FUNCTIONS_ENV):
            for entry in sorted(f for f in functions if f.partition(":")[0] == name):
                print(f"        {entry.partition(':')[2]}", file=sys.stderr)
    return [
        h.row("step files, both processes", len(union), "files", target=f"<= {TARGET}", ok=None),
        h.row("step files, controller", len(controller), "files"),
        h.row("step files, a worker", len(workers), "files"),
        h.row("step files, in both", len(controller & workers), "files"),
    ]


if __name__ == "__main__":
    h.main(run, __doc__)

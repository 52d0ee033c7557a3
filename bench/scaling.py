"""Step time over 1, 2 and 4 DP workers (0.5 CPU each), the plain loop alongside (smoke: 1)."""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench.plain_loop import plain_run, pretokenize  # noqa: E402


def run() -> list[dict]:
    with h.workspace() as (data, tmp):
        return _scaling(data, tmp)


WORLDS = h.pick((1, 2, 4), (1,))  # DP sizes (smoke: DP=2 runs in overhead.py and prefetch.py)


def _scaling(data: Path, tmp: Path) -> list[dict]:
    rows = []
    for world in WORLDS:
        raw = h.raw_config(
            h.COMPUTE, data, tmp / f"e-{world}", h.STEPS // 2 + h.WARMUP, world=world
        )
        steps = raw["sft"]["max_num_steps"]
        batches = pretokenize(raw, world, steps, tmp / f"batches-{world}.pt")
        plain = plain_run(raw, world, steps, batches)
        ours = h.runtime_run(raw)
        t_ref, t_ours = h.step_time(plain["times"]), h.step_time(ours["times"])
        rows.append(h.row(f"step.scaling.dp{world}", t_ours * 1e3, "ms", t_ref * 1e3))
    return rows


if __name__ == "__main__":
    h.main(run, __doc__)

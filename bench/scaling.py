"""Step time over 1, 2 and 4 DP workers (0.5 CPU each), the plain loop alongside (smoke: 1).

Each size runs ``ROUNDS`` alternating pairs (the plain loop, then sft-runtime) of
`h.LONG_STEPS` steps and reports the median of the pairs' ratios, with the overhead per step
in ms beside it: on a shared machine a pair's two runs see about the same load, the next pair
may not. Where the machine has a core for every worker and one more for the controller, Ray
and the driver, the ratio is held to ``h.CORE_EACH_TARGET``; on fewer cores the workers and
the controller take turns on them, and the row has no target (`bench/overhead.py` shows
where that CPU goes).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench.plain_loop import plain_run, pretokenize  # noqa: E402

WORLDS = h.pick((1, 2, 4), (1,))  # DP sizes (smoke: a run on two workers is load_memory.py's)
ROUNDS = h.pick(3, 1)  # pairs per size
STEPS = h.LONG_STEPS  # steps per run


def run() -> list[dict]:
    with h.workspace() as (data, tmp):
        return _scaling(data, tmp)


def _scaling(data: Path, tmp: Path) -> list[dict]:
    rows = []
    for world in WORLDS:
        ref, ours = [], []
        batches = None
        for i in range(ROUNDS):
            raw = h.raw_config(h.COMPUTE, data, tmp / f"e-{world}-{i}", STEPS, world=world)
            if batches is None:
                batches = pretokenize(raw, world, STEPS, tmp / f"batches-{world}.pt")
            ref.append(h.step_time(plain_run(raw, world, STEPS, batches)["times"]))
            ours.append(h.step_time(h.runtime_run(raw)["times"]))
            print(
                f"scaling.py: dp{world} round {i + 1}/{ROUNDS}: plain {ref[-1] * 1e3:.1f} ms, "
                f"sft-runtime {ours[-1] * 1e3:.1f} ms ({ours[-1] / ref[-1]:.3f}x)",
                file=sys.stderr,
                flush=True,
            )
        ratio = statistics.median(o / r for o, r in zip(ours, ref, strict=True))
        core_each = h.core_each(world)
        rows += [
            h.row(
                f"step.scaling.dp{world}",
                statistics.median(ours) * 1e3,
                "ms",
                statistics.median(ref) * 1e3,
                f"<= {h.CORE_EACH_TARGET}x (a core each)" if core_each else "",
                ratio <= h.CORE_EACH_TARGET if core_each else None,
                ratio,
            ),
            h.row(
                f"step.scaling.dp{world}.overhead_per_step",
                statistics.median(o - r for o, r in zip(ours, ref, strict=True)) * 1e3,
                "ms",
            ),
        ]
    return rows


if __name__ == "__main__":
    h.main(run, __doc__)

"""A loading-heavy config: sft-runtime reading ahead against the plain loop loading inline.

Each rank of the plain loop drives its own `ColocatedLoader` inline (load, train, commit),
with a config where loading costs at least a third of a step. sft-runtime reads ahead
(``data_plane.max_partitions=2``, ``data.num_workers=1``) on one DP worker, which leaves
a 2-core machine a core to load on. Target: faster (< 1.0x). The same at DP=2 is shown
without a target: two workers already fill both cores. Beside them, sft-runtime's default
(``data_plane.load_during_allreduce``: the next batch read while the gradients are
all-reduced) and loading inline (``load_during_allreduce=false``), whose load latency is
what makes the config loading-heavy.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench.plain_loop import plain_run  # noqa: E402

# The DP=2 rows (smoke: left out; they run the DP=1 rows' code, read-ahead without a loader
# process runs in bench/overhead.py, and bench/load_memory.py trains on two workers end to end)
DP2 = h.pick(True, False)
# Full: a run with the default data plane (reading during the all-reduce) in each round.
# Smoke: the run loading inline stands for it (the same `h.runtime_run`; the default data
# plane is what bench/overhead.py and bench/scaling.py run, and smoke figures mean nothing).
DEFAULT_RUNS = h.pick(True, False)


def run() -> list[dict]:
    with h.workspace() as (data, tmp):
        return _prefetch(data, tmp)


def _prefetch(data: Path, tmp: Path) -> list[dict]:
    """(b) loading-heavy config: sft-runtime reading ahead vs the plain loop loading inline.

    The target h.row runs one DP worker, so the machine (2 cores here) has a core free to load
    on: ``max_partitions=2`` with ``data.num_workers=1`` builds the next batches in a
    loader process while the step trains. A read-ahead thread alone cannot win here: the
    byte tokenizer and a tiny model are both Python, so they take turns on the GIL. The DP=2
    rows show the other case on this machine: two workers already fill both cores, so
    there is no idle core to hide loading on (no target).
    """
    one = _loading_case(data, tmp, 1, {"num_workers": 1})
    ms = 1e3
    rows = [
        h.row(
            "step.loading_heavy.dp1.sft_runtime_prefetch",
            one["on"] * ms,
            "ms",
            one["ref"] * ms,
            "< 1.0x (plain loads inline)",
            one["ratio_on"] < 1.0,
            one["ratio_on"],
        ),
        h.row(
            "step.loading_heavy.dp1.load_over_plain_step",
            one["load_frac"],
            "ratio",
            None,
            ">= 0.33",
            one["load_frac"] >= 1 / 3,
        ),
        h.row(
            "step.loading_heavy.dp1.sft_runtime_during_allreduce",
            one["during"] * ms,
            "ms",
            one["ref"] * ms,
        ),
        h.row(
            "step.loading_heavy.dp1.loader_latency_max_prefetch",
            one["lat_on"] * ms,
            "ms",
            one["lat_off"] * ms,
        ),
    ]
    if not DP2:
        return rows
    two = _loading_case(data, tmp, 2, {})
    return rows + [
        h.row(
            "step.loading_heavy.dp2.sft_runtime_prefetch2", two["on"] * ms, "ms", two["ref"] * ms
        ),
        h.row("step.loading_heavy.dp2.sft_runtime_inline", two["off"] * ms, "ms", two["ref"] * ms),
        h.row(
            "step.loading_heavy.dp2.sft_runtime_during_allreduce",
            two["during"] * ms,
            "ms",
            two["ref"] * ms,
        ),
        h.row(
            "step.loading_heavy.dp2.loader_latency_max_prefetch2",
            two["lat_on"] * ms,
            "ms",
            two["lat_off"] * ms,
        ),
    ]


def _loading_case(data: Path, tmp: Path, world: int, data_on: dict) -> dict[str, float]:
    """Plain inline loop, sft-runtime with read-ahead (``data_on`` over its data section),
    loading inline, and reading during the all-reduce (the default), alternating for
    h.ROUNDS rounds; medians of step times, ratios and loader latencies."""
    got: dict[str, list[float]] = {}

    def keep(**values: float) -> None:
        for key, value in values.items():
            got.setdefault(key, []).append(value)

    for i in range(h.ROUNDS):
        plain = plain_run(
            h.raw_config(h.LOADING, data, tmp, h.STEPS, world=world), world, h.STEPS, None
        )
        raw_on = h.raw_config(h.LOADING, data, tmp / f"b{world}-on-{i}", h.STEPS, world, prefetch=2)
        raw_on["data"].update(data_on)
        b = h.runtime_run(raw_on)
        raw_off = h.raw_config(h.LOADING, data, tmp / f"b{world}-off-{i}", h.STEPS, world)
        raw_off["data_plane"]["load_during_allreduce"] = False
        a = h.runtime_run(raw_off)
        raw_during = h.raw_config(h.LOADING, data, tmp / f"b{world}-dur-{i}", h.STEPS, world)
        c = h.runtime_run(raw_during) if DEFAULT_RUNS else a
        t_ref, t_on, t_off, t_during = (
            h.step_time(plain["times"]),
            h.step_time(b["times"]),
            h.step_time(a["times"]),
            h.step_time(c["times"]),
        )
        lat_off = statistics.median(a["load"][h.WARMUP :])
        keep(ref=t_ref, on=t_on, off=t_off, during=t_during)
        keep(ratio_on=t_on / t_ref, load_frac=lat_off / t_ref)
        keep(lat_off=lat_off, lat_on=statistics.median(b["load"][h.WARMUP :]))
    return {key: statistics.median(values) for key, values in got.items()}


if __name__ == "__main__":
    h.main(run, __doc__)

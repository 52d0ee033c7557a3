"""End-to-end step time of sft-runtime against the plain loop on pre-tokenized batches.

The plain loop does no loading at all (its batches are the very loader stream sft-runtime
trains on, written beforehand), so the ratio is what the runtime adds to a step: Ray calls,
the controller, events, spans, checkpoints. Targets (`target`): <= 1.05x where every worker
and the controller have a core of their own, <= 1.15x where the workers fill the cores (the
controller's and Ray's CPU is then time some worker waits); read-ahead on and off; the losses
must agree exactly. The ratio is the median of ROUNDS rounds, with the lowest and highest
round beside it: on a shared machine one round moves by several hundredths. Beside the
ratio: the CPU each process of the run takes per step (`bench.cpu_share`), where an overhead
on a machine without spare cores goes, with the plain loop's ranks beside them
(``plain_rank<r>``: a worker's CPU less its rank's is what the runtime adds in that process),
two parts of the overhead that are work the plain loop skips (checkpoints and loading), and
where a worker's step goes, phase by phase, beside the plain loop's own (``step.phase.*``,
from the run's spans: `bench.timeline`).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench.cpu_share import CpuSampler  # noqa: E402
from bench.plain_loop import plain_run, pretokenize  # noqa: E402
from bench.timeline import plain_phases, worker_phases  # noqa: E402

# DP workers (smoke: one; a run on two workers trains in load_memory.py)
WORLD = h.pick(2, 1)
STEPS = h.LONG_STEPS
ROUNDS = h.pick(5, 1)
SHARED_CORES_TARGET = 1.15  # the workers fill the cores: the controller takes from them


def target(world: int) -> tuple[float, str]:
    """The ratio this machine should meet with ``world`` workers, and why."""
    if h.core_each(world):
        return h.CORE_EACH_TARGET, "a core each"
    return SHARED_CORES_TARGET, f"{h.usable_cores()} cores, {world} workers"


def run() -> list[dict]:
    """sft-runtime (read-ahead off and on) vs the plain loop, ROUNDS rounds."""
    with h.workspace() as (data, tmp):
        return _overhead(data, tmp)


def _overhead(data: Path, tmp: Path) -> list[dict]:
    def raw(run_dir: Path, prefetch: int = 1) -> dict:
        return h.raw_config(h.COMPUTE, data, run_dir, STEPS, WORLD, prefetch)

    batches = pretokenize(raw(tmp), WORLD, STEPS, tmp / "batches.pt")
    ref, off, on, r_off, r_on, cpu, plain_cpu, parts = [], [], [], [], [], [], [], []
    phases, ref_phases = [], []
    losses = None
    for i in range(ROUNDS):
        plain = plain_run(raw(tmp), WORLD, STEPS, batches)
        plain_cpu.append(
            {f"plain_rank{r}": h.step_time(c) for r, c in enumerate(plain["rank_cpu"])}
        )
        ref_phases.append(plain_phases(plain["phases"], h.WARMUP + 1))
        sampler = CpuSampler(h.WARMUP, STEPS - 2)  # the last rows may come after the end
        a = h.runtime_run(raw(tmp / f"a-off-{i}"), on_step=sampler.on_step)
        cpu.append(sampler.per_step())
        phases.append(worker_phases(tmp / f"a-off-{i}", h.WARMUP + 1))
        parts.append(_parts(a))
        b = h.runtime_run(raw(tmp / f"a-on-{i}", prefetch=2))
        t_ref, t_off, t_on = (
            h.step_time(plain["times"]),
            h.step_time(a["times"]),
            h.step_time(b["times"]),
        )
        ref.append(t_ref)
        off.append(t_off)
        on.append(t_on)
        r_off.append(t_off / t_ref)
        r_on.append(t_on / t_ref)
        print(
            f"overhead.py: round {i + 1}/{ROUNDS}: plain {t_ref * 1e3:.1f} ms, "
            f"sft-runtime {t_off * 1e3:.1f} ms, prefetch2 {t_on * 1e3:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
        losses = (plain["losses"], a["losses"], b["losses"])
    diff = max(max(abs(x - y), abs(x - z)) for x, y, z in zip(*losses, strict=True))
    ratio_off, ratio_on = statistics.median(r_off), statistics.median(r_on)
    ms = 1e3
    limit, why = target(WORLD)
    text = f"<= {limit}x ({why})"
    rows = [
        h.row(
            name,
            statistics.median(times) * ms,
            "ms",
            statistics.median(ref) * ms,
            text,
            ratio <= limit,
            ratio,
        )
        for name, times, ratio in (
            ("step.time.sft_runtime", off, ratio_off),
            ("step.time.sft_runtime_prefetch2", on, ratio_on),
        )
    ]
    rows += [
        h.row(f"step.ratio.sft_runtime.{which}_round", extreme(r_off), "x")
        for which, extreme in (("lowest", min), ("highest", max))
    ]
    extra = statistics.median(b - a for a, b in zip(ref, off, strict=True)) * ms
    return [
        *rows,
        h.row("step.overhead_per_step (sft-runtime - plain)", extra, "ms"),
        h.row("step.max_loss_diff_vs_plain", diff, "nats", None, "== 0", diff == 0.0),
        *[
            h.row(f"step.overhead_per_step.{name}", statistics.median(p[name] for p in parts), "ms")
            for name in ("checkpoints", "loading")
        ],
        *_phase_rows(phases, ref_phases),
        *_cpu_rows([_with_total(c, "all") for c in cpu], statistics.median(off) * ms),
        *_cpu_rows([_with_total(c, "plain_all") for c in plain_cpu], statistics.median(ref) * ms),
    ]


def _phase_rows(rounds: list[dict[str, float]], ref: list[dict[str, float]]) -> list[dict]:
    """Where a worker's step goes (ms, median over rounds; `bench.timeline`), beside the
    same phase of the plain loop's rank 0 where it has one: ``between_calls`` is a worker
    waiting for Ray to hand it its next call, ``call_overhead`` its calls' own time outside
    the phases."""
    rows = []
    for key in sorted({k for r in rounds for k in r}):
        plain = [r[key] for r in ref if key in r]
        rows.append(
            h.row(
                f"step.phase.{key}",
                statistics.median(r.get(key, 0.0) for r in rounds),
                "ms",
                statistics.median(plain) if plain else None,
            )
        )
    return rows


def _with_total(cpu: dict[str, float], name: str) -> dict[str, float]:
    """A round's CPU per step with the sum of its processes under ``name``: on a machine
    whose cores are all busy, the two sides' totals bound what their step times can be."""
    return {**cpu, name: sum(cpu.values())} if cpu else cpu


def _parts(run: dict) -> dict[str, float]:
    """Two known parts of the overhead per step (ms) in one run's steady window, both work
    the plain loop does not do: the checkpoints (the mean interval less the mean of the
    intervals that no save precedes) and the loading (the slowest rank's load, which the
    step waits for when read-ahead is off)."""
    times, steps = run["times"][h.WARMUP - 1 :], run["steps"][h.WARMUP - 1 :]
    intervals = {s: b - a for s, a, b in zip(steps[1:], times, times[1:], strict=False)}
    plain = [v for s, v in intervals.items() if (s - 1) % h.SAVE_PERIOD != 0]
    saves = statistics.mean(intervals.values()) - statistics.mean(plain or [0.0])
    return {
        "checkpoints": 1e3 * saves,
        "loading": 1e3 * statistics.median(run["load"][h.WARMUP :]),
    }


def _cpu_rows(rounds: list[dict[str, float]], step_ms: float) -> list[dict]:
    """CPU ms per step of each process of a side (the read-ahead-off runs, or the plain
    loop's ranks; median over rounds), against that side's step wall time: on as many cores
    as workers, what the controller, the driver and Ray's daemons take is time some worker
    waits."""
    keys = sorted({key for cpu in rounds for key in cpu})
    return [
        h.row(
            f"step.cpu_per_step.{key}",
            statistics.median(cpu.get(key, 0.0) for cpu in rounds) * 1e3,
            "ms",
            step_ms,
            ratio=statistics.median(cpu.get(key, 0.0) for cpu in rounds) * 1e3 / step_ms,
        )
        for key in keys
    ]


if __name__ == "__main__":
    h.main(run, __doc__)

"""Resume time and peak memory.

Wall time from launching ``sft-runtime train`` to its first committed step, resumed from a
checkpoint at step 10, against a cold start of the same config (target <= 1.2x). Peak RSS
(VmHWM) of the driver, the controller and each worker is read from /proc while those runs
go.
"""

from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cli_runs  # noqa: E402
from bench import harness as h  # noqa: E402


def run() -> list[dict]:
    rows: list[dict] = []
    # the runs start their own Ray, like a user's (smoke: they all join one started here, so
    # that `cli_runs.cli_run` finds their processes under this one alone)
    with h.workspace(ray=False, own_ray=True) as (data, tmp):
        cold, warm, rss = resume_bench(data, tmp)
        c, w = statistics.median(cold), statistics.median(warm)
        ratio = statistics.median(b / a for a, b in zip(cold, warm, strict=True))
        rows.append(
            h.row(
                "step.resume_to_first_step",
                w,
                "s",
                c,
                f"<= {h.RESUME_TARGET}x cold",
                ratio <= h.RESUME_TARGET,
                ratio,
            )
        )
        for name in sorted(rss):
            rows.append(h.row(f"step.peak_rss.{name}", rss[name], "MiB"))
    return rows


SAVED = h.SAVE_PERIOD  # the step resumed from (full: 10)
# DP workers of the runs (smoke: one; a resume takes the same code at any count, and
# bench/load_memory.py trains on two workers end to end)
WORLD = h.pick(2, 1)
END = SAVED + 2  # both runs end here (full: 12)
# Full: a run of its own leaves the checkpoint every warm run resumes from. Smoke: the cold
# run does, ending at SAVED (its first step comes as soon), which spares a run.
COLD_RUN_PREPARES = h.pick(False, True)


def resume_bench(data: Path, tmp: Path) -> tuple[list[float], list[float], dict]:
    """Cold start vs resume from step 10, alternating; first-step latencies and peak RSS."""
    import yaml

    prepared = tmp / "resume-base"
    if not COLD_RUN_PREPARES:
        base_raw = h.raw_config(h.COMPUTE, data, prepared, SAVED, WORLD)
        h.runtime_run(base_raw)  # leaves a checkpoint at step 10
    cold, warm, rss = [], [], {}
    for i in range(h.ROUNDS):
        cold_dir = tmp / f"cold-{i}"
        cfg = tmp / f"cold-{i}.yaml"
        end = SAVED if COLD_RUN_PREPARES else END
        cfg.write_text(yaml.safe_dump(h.raw_config(h.COMPUTE, data, cold_dir, end, WORLD)))
        out = cli_runs.cli_run(cfg, cold_dir)
        cold.append(out["first_step_s"])
        rss = out["rss"]
        if COLD_RUN_PREPARES:
            prepared = cold_dir  # its checkpoint at SAVED (`h.SAVE_PERIOD`)
        warm_dir = tmp / f"warm-{i}"
        shutil.copytree(prepared, warm_dir)
        cfg = tmp / f"warm-{i}.yaml"
        cfg.write_text(yaml.safe_dump(h.raw_config(h.COMPUTE, data, warm_dir, END, WORLD)))
        warm.append(cli_runs.cli_run(cfg, warm_dir)["first_step_s"])
    return cold, warm, rss


if __name__ == "__main__":
    h.main(run, __doc__)

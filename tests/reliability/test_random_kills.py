"""SIGKILL the whole process group of `sft-runtime train` at seeded random points of the run.

Like a node that loses power (or a scheduler that kills the job): no signal handler, no
cleanup. The randomness is in *where* each launch dies: a seeded choice of fault point
(start-up, a phase of a step, a worker's forward/backward or optimizer, a moment of a
checkpoint) and step. The launch holds at that point (``SFT_RUNTIME_FAULT_HOLD``) and the
test kills the process group once the hold file says it is there, so the kill lands where
the plan says on a fast machine and on a slow one. The first kill may land anywhere; the
later ones lose a committed step that no checkpoint covers, so the resume has to run
committed steps again. Ray starts its workers in sessions of their own, so they outlive the
process group for a moment; the harness waits for them (ending by pid any that outlive a
grace period) before the next launch. The lock file stays behind naming a dead process and
must not block the resume. Then the same command finishes and the run is compared with the
uninterrupted reference. The scenarios (read-ahead off with checkpoints written in step,
read-ahead on, FSDP2) run side by side.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sft_runtime.events import read_log, records_in_effect
from sft_runtime.events.log import lock_holder
from tests.support.reliability import (
    FSDP,
    PREFETCH,
    STEPS,
    Runner,
    compare,
    reap,
    summary_line,
    tagged_pids,
)

SEED = 7_2024
KILLS = 3
SAVE_PERIOD = 3  # small_run's checkpoints: every 3 steps and the last
CHECKPOINTS = {s for s in range(1, STEPS + 1) if s % SAVE_PERIOD == 0} | {STEPS}
START = ("driver:after_setup", "setup:after_loaders")
IN_CONTROLLER = ("stepping:after_loading", "stepping:after_train", "stepping:after_commit")
IN_WORKER = ("worker:train", "worker:finish")  # may run before the previous step's append
SAVING = ("saving:after_weights", "saving:before_rename", "saving:after_rename")


def _comes_free(lock, bound_s: float = 120.0) -> bool:
    """The kernel drops a dead process's flock once the process has closed its files; an
    exiting process may still be closing them, so wait for that (bounded, no timing claim)."""
    deadline = time.monotonic() + bound_s
    while True:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
        finally:
            os.close(fd)
        time.sleep(0.05)


def _last_checkpoint(run_dir) -> int:
    if not (run_dir / "events.jsonl").exists():
        return 0
    saved = [
        r.data["step"] for r in records_in_effect(read_log(run_dir)) if r.type == "checkpoint_saved"
    ]
    return max(saved, default=0)


def _candidates(covered: int, first: bool) -> list[tuple[str, int | None]]:
    """Fault points a launch resumed from checkpoint ``covered`` is certain to reach.

    The first launch may die anywhere; later ones only where a committed step that no
    checkpoint covers is lost (the step just appended, or the step before the one the
    controller is in), so the next resume must execute it again.
    """
    out: list[tuple[str, int | None]] = []
    if first:
        out += [(point, None) for point in START]
        out += [(p, s) for s in range(covered + 1, STEPS + 1) for p in IN_CONTROLLER + IN_WORKER]
        out += [(p, s) for s in sorted(CHECKPOINTS) if covered < s < STEPS for p in SAVING]
    out += [("stepping:after_record", s) for s in range(covered + 1, STEPS)]
    lost_before = [s for s in range(covered + 2, STEPS + 1) if s - 1 not in CHECKPOINTS]
    out += [(p, s) for s in lost_before for p in IN_CONTROLLER]
    return out


# read-ahead off with checkpoints written before the next step (the default writes them
# while it trains: the kill-point chains), read-ahead on, sharded
IN_STEP_WRITES = ("checkpointing.background_writes=false",)
SCENARIOS = {"read_ahead_off": IN_STEP_WRITES, "read_ahead_on": PREFETCH, "fsdp": FSDP}


def _kill_then_finish(runner, overrides: tuple[str, ...]) -> dict:
    """KILLS seeded SIGKILLs of the launch's process group, then the same command to the end."""
    rng = random.Random(f"{SEED}:{'/'.join(overrides)}")
    log = runner.run_dir / "events.jsonl"
    kills, notes = 0, []
    for i in range(KILLS):
        covered = _last_checkpoint(runner.run_dir)
        point, step = rng.choice(_candidates(covered, first=i == 0))
        rank = rng.choice([0, 1]) if point.startswith("worker:") else None
        fault = point if step is None else f"{point}@{step}"
        hold = runner.root / f"hold-{i}"
        proc, tag = runner.start(fault, rank, hold=hold)
        where = runner.wait_held(proc, tag, hold)
        assert where["point"] == point, where
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        size_at_kill = log.stat().st_size if log.exists() else 0
        kills += 1
        lived, killed = reap(tag)
        assert tagged_pids(tag) == []
        hold.unlink()
        grew = (log.stat().st_size if log.exists() else 0) - size_at_kill
        notes.append(
            f"kill {kills} at {fault}"
            + (f" rank {rank}" if rank is not None else "")
            + f" (checkpoint {covered} behind): orphans gone after {lived:.1f}s "
            f"({killed} ended by pid), log grew {grew} B after the kill"
        )
        lock = runner.run_dir / "events.lock"
        if lock.exists():  # the stale lock: names a pid of the killed launch, and comes free
            holder = lock_holder(lock).get("pid")
            assert holder is None or holder not in tagged_pids(
                f"{runner.session_tag}:{runner.name}"
            )
            assert _comes_free(lock), f"{lock} still locked after the killed launch is gone"
    finish = runner.finish()
    return {"kills": kills, "notes": notes, "finish": finish}


@pytest.fixture(scope="module")
def random_runs(demo_data, launch_env, tmp_path_factory):
    """Every scenario, side by side (each launch mostly waits for Ray to start)."""
    ray_tmp, tag = launch_env
    runners = {
        name: Runner(
            tmp_path_factory.mktemp(f"random_{name}"),
            demo_data,
            ray_tmp,
            tag,
            f"random_{name}",
            overrides=overrides,
        )
        for name, overrides in SCENARIOS.items()
    }
    with ThreadPoolExecutor(len(SCENARIOS)) as pool:
        futures = {n: pool.submit(_kill_then_finish, runners[n], SCENARIOS[n]) for n in SCENARIOS}
        done = {
            n: (f.result() if f.exception() is None else f.exception()) for n, f in futures.items()
        }
    return {n: (runners[n], done[n]) for n in SCENARIOS}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_random_sigkills_then_resume_is_exact(scenario, random_runs, request):
    runner, outcome = random_runs[scenario]
    if isinstance(outcome, BaseException):
        raise outcome
    fsdp = SCENARIOS[scenario] == FSDP
    reference = request.getfixturevalue("fsdp_reference" if fsdp else "reference")
    kills, notes, finish = outcome["kills"], outcome["notes"], outcome["finish"]
    assert all("already being written" not in launch.output for launch in runner.launches)
    cmp = compare(runner.run_dir, reference)
    print("\n" + summary_line(f"random-sigkill {scenario}", kills, len(finish), cmp))
    for note in notes:
        print("  " + note)
    assert kills == KILLS
    assert cmp.reexecuted >= 1, "no kill cost a step: nothing re-executed was compared"
    assert cmp.mismatches == []

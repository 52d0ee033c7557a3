"""Issue 7.2: SIGKILL the whole process group of `sft-runtime train` at random moments.

Like a node that loses power (or a scheduler that kills the job): no signal handler, no
cleanup. The first kill lands after a seeded random delay (mostly while Ray and the
workers start), the others a seeded moment just after a step that no checkpoint covers
yet, so the resume has to run committed steps again. Ray starts its workers in sessions
of their own, so they outlive the process group for a moment; the harness waits for them
(ending by pid any that outlive a grace period) before the next launch. The lock file
stays behind naming a dead process and must not block the resume. Then the same command
finishes and the run is compared with the uninterrupted reference.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import time

import pytest
from reliability_harness import PREFETCH, compare, reap, summary_line, tagged_pids

from events.log import lock_holder

SEED = 7_2024
KILLS = 3


def _rows(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.parametrize("overrides", [(), PREFETCH], ids=["read_ahead_off", "read_ahead_on"])
def test_random_sigkills_then_resume_is_exact(make_runner, reference, overrides):
    rng = random.Random(SEED)
    runner = make_runner("random", overrides=overrides)
    metrics, log = runner.run_dir / "metrics.jsonl", runner.run_dir / "events.jsonl"
    kills, notes = 0, []
    for i in range(KILLS):
        proc, tag = runner.start()
        rows = _rows(metrics)
        if i == 0:
            deadline = time.monotonic() + rng.uniform(2.0, 10.0)
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
        else:
            # a step past the last checkpoint (1 or 4, with checkpoints every 3), so
            # the kill loses committed steps that the resume must re-execute identically
            target = rows + 1
            while target % 3 != 1:  # 1 or 4: the next step is not a checkpoint step either
                target += 1
            limit = time.monotonic() + 240
            while _rows(metrics) < target and proc.poll() is None and time.monotonic() < limit:
                time.sleep(0.002)
            # steps take 15-100 ms here and the next checkpoint is two steps away: kill soon
            time.sleep(rng.uniform(0.0, 0.005))
        if proc.poll() is not None:  # it finished (or failed) before the kill
            out, _ = proc.communicate()
            assert proc.returncode in (0, 1), out[-3000:]
            assert "already being written" not in out, out[-3000:]
            reap(tag)
            continue
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        size_at_kill = log.stat().st_size if log.exists() else 0
        kills += 1
        lived, killed = reap(tag)
        assert tagged_pids(tag) == []
        grew = (log.stat().st_size if log.exists() else 0) - size_at_kill
        notes.append(
            f"kill {kills}: orphans gone after {lived:.1f}s ({killed} ended by pid), "
            f"log grew {grew} B after the kill"
        )
        lock = runner.run_dir / "events.lock"
        if lock.exists():  # the stale lock: names a pid of the killed launch, and is free
            holder = lock_holder(lock).get("pid")
            assert holder is None or holder not in tagged_pids(runner.session_tag)
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
    finish = runner.finish()
    assert all("already being written" not in launch.output for launch in runner.launches)
    cmp = compare(runner.run_dir, reference)
    print("\n" + summary_line("random-sigkill", kills, len(finish), cmp))
    for note in notes:
        print("  " + note)
    assert kills >= 2
    assert cmp.reexecuted >= 1, "no kill cost a step: nothing re-executed was compared"
    assert cmp.mismatches == []

"""`verify` on a run that is still training reports no false failure.

The run saves a checkpoint every step and keeps only two, so checkpoints appear and are
pruned all the time; `verify` is called again and again until the run's process exits.
Each call must pass: it checks only the checkpoints its reading of the log records, and a
recorded checkpoint that is gone counts as missing only when a fresh reading of the log
shows that the retention rules keep it.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal

from sft_runtime.runtime.cli.main import main
from tests.support.reliability import LAUNCH_TIMEOUT_S, reap

STEPS = 16
LIVE = ("checkpointing.save_period=1", "checkpointing.keep_top_k=2")


def _verify(run_dir) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["verify", str(run_dir)])
    return rc, out.getvalue()


def test_verify_while_the_run_saves_and_prunes_reports_no_false_failure(make_runner):
    runner = make_runner("live", steps=STEPS, overrides=LIVE)
    log = runner.run_dir / "events.jsonl"
    proc, tag = runner.start()
    calls: list[tuple[int, str]] = []
    try:
        while proc.poll() is None:  # until the run's process exits, however long it takes
            if log.is_file():
                calls.append(_verify(runner.run_dir))
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        reap(tag)
    assert proc.returncode == 0, output[-3000:]
    failed = [out for rc, out in calls if rc != 0]
    assert not failed, f"{len(failed)} of {len(calls)} calls failed; the first:\n{failed[0]}"
    # the calls saw the run at work: checkpoints checked, and some already pruned
    checked = [out for _, out in calls if "checkpoints agree: [" in out and "agree: []" not in out]
    pruned = [out for _, out in calls if "pruned by retention: [" in out]
    assert len(checked) >= 5 and pruned, f"{len(calls)} calls, {len(checked)} checked"
    rc, out = _verify(runner.run_dir)  # and after the end: the newest is always kept
    agree = next(line for line in out.splitlines() if line.startswith("checkpoints agree:"))
    assert rc == 0 and agree.endswith(f"{STEPS}]"), out

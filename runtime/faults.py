"""Fault injection for the reliability tests: kill this process at a named point.

Off unless ``SFT_RUNTIME_FAULT`` is set, as ``POINT@STEP`` (or ``POINT@STEP@ATTEMPT``,
or ``POINT`` for the first time the point is reached). The process that reaches the point
(driver, controller or worker) SIGKILLs itself: no cleanup, no flush, no atexit, exactly
like a machine that loses power. Ray actors inherit the variables from the driver that
started the embedded cluster; ``SFT_RUNTIME_FAULT_RANK`` picks one worker rank.

Points (state:phase):
  setup:after_loaders        loaders built, before loaders_ready
  stepping:after_load        batches loaded (the train calls queued behind them)
  stepping:after_optimizer   optimizer step taken, before the loader commit
  stepping:after_commit      loader commit sent, before step_committed is appended
  stepping:after_append      step_committed durable, before the metrics line
  saving:after_weights       policy files written, loader states taken, not yet written
  saving:before_rename       tmp_step_N complete, before the rename
  saving:after_rename        step_N in place, before checkpoint_saved
  saving:after_record        checkpoint_saved durable, before pruning
  closing:before_stop        loaders closed, before run_stopped
  worker:train               inside a worker's forward/backward
  worker:finish              inside a worker, before its optimizer step
  driver:after_setup         workers up, before the controller starts
"""

from __future__ import annotations

import os
import signal

ENV = "SFT_RUNTIME_FAULT"
POINTS = frozenset(
    {
        "setup:after_loaders",
        "stepping:after_load",
        "stepping:after_optimizer",
        "stepping:after_commit",
        "stepping:after_append",
        "saving:after_weights",
        "saving:before_rename",
        "saving:after_rename",
        "saving:after_record",
        "closing:before_stop",
        "worker:train",
        "worker:finish",
        "driver:after_setup",
    }
)


def parse(spec: str) -> tuple[str, int | None, int | None]:
    """'POINT[@STEP[@ATTEMPT]]' -> (point, step, attempt); unknown points are refused."""
    parts = spec.strip().split("@")
    point = parts[0]
    if point not in POINTS or len(parts) > 3:
        raise ValueError(
            f"{ENV}={spec!r}: expected POINT[@STEP[@ATTEMPT]] with POINT one of "
            + ", ".join(sorted(POINTS))
        )
    step = int(parts[1]) if len(parts) > 1 and parts[1] else None
    attempt = int(parts[2]) if len(parts) > 2 else None
    return point, step, attempt


def fault_point(
    point: str, *, step: int | None = None, attempt: int | None = None, rank: int | None = None
) -> None:
    """SIGKILL this process when ``SFT_RUNTIME_FAULT`` names this point (and step, attempt).

    In workers, ``SFT_RUNTIME_FAULT_RANK`` limits the fault to one rank.
    """
    spec = os.environ.get(ENV)
    if not spec:
        return
    only_rank = os.environ.get(ENV + "_RANK")
    if rank is not None and only_rank not in (None, "") and int(only_rank) != rank:
        return
    want, want_step, want_attempt = parse(spec)
    if want != point:
        return
    if want_step is not None and step != want_step:
        return
    if want_attempt is not None and attempt != want_attempt:
        return
    os.kill(os.getpid(), signal.SIGKILL)

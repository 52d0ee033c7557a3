"""Fault injection for the reliability tests: kill this process at a named point.

Off unless ``SFT_RUNTIME_FAULT`` is set, as ``POINT@STEP`` (or ``POINT@STEP@ATTEMPT``,
or ``POINT`` for the first time the point is reached). The process that reaches the point
(driver, controller or worker) SIGKILLs itself: no cleanup, no flush, no atexit, exactly
like a machine that loses power. ``SFT_RUNTIME_FAULT_RANK`` picks one worker rank. The
controller and worker actors get these variables from the driver's environment (see
`fault_env`), so a fault reaches them on an embedded or an existing cluster alike.

With ``SFT_RUNTIME_FAULT_HOLD=PATH`` the process does not kill itself: it writes PATH (its
pid, the point and the step, as JSON) and waits there until PATH is deleted, then goes on.
A test decides from that file, not from a clock, when the run is exactly where it wants
it: it can kill any process of the run, signal it, or look at the files, then release it.
A process holds at most once.

Points (state:moment; a step's are ``stepping:after_<phase>`` with the phase names of
`states.machine.StepPhase`, the names step_aborted records):
  setup:after_loaders        loaders built, before loaders_ready
  stepping:after_loading     batches loaded (the train calls queued behind them)
  stepping:after_train       optimizer step taken, before the loader commit
  stepping:after_commit      loader commit marked, before step_committed is appended
  stepping:after_record      step_committed durable, before the metrics line
  validating:after_pass      the workers validated step STEP, before validation_completed
  saving:after_weights       policy files written, loader states taken, not yet written
  saving:before_rename       tmp_step_N complete, before the rename
  saving:after_rename        step_N in place, before checkpoint_saved
  saving:after_record        checkpoint_saved durable, before pruning
  closing:before_stop        loaders closed, before run_stopped
  worker:train               inside a worker's forward/backward
  worker:finish              inside a worker, before its optimizer step
  driver:after_setup         workers up, before the controller starts
  export:after_shard         `sft-runtime export` wrote weight file STEP, before the rest
"""

from __future__ import annotations

import json
import os
import signal
import time

from sft_runtime.runtime.process.ray_node import inherited_env
from sft_runtime.states.machine import StepPhase

ENV = "SFT_RUNTIME_FAULT"
HOLD_ENV = ENV + "_HOLD"
_held = False
POINTS = frozenset(
    {
        "setup:after_loaders",
        *(
            p.fault_point
            for p in (StepPhase.loading, StepPhase.train, StepPhase.commit, StepPhase.record)
        ),
        "validating:after_pass",
        "saving:after_weights",
        "saving:before_rename",
        "saving:after_rename",
        "saving:after_record",
        "closing:before_stop",
        "worker:train",
        "worker:finish",
        "driver:after_setup",
        "export:after_shard",
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
    hold = os.environ.get(HOLD_ENV)
    if hold:
        _hold_at(hold, point, step, rank)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def _hold_at(path: str, point: str, step: int | None, rank: int | None) -> None:
    """Announce the point in ``path`` and wait until someone deletes it."""
    global _held
    if _held:
        return
    _held = True
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "point": point, "step": step, "rank": rank}, f)
    os.replace(tmp, path)  # the file appears whole or not at all
    while os.path.exists(path):
        time.sleep(0.01)


def actor_fault_options(env: dict[str, str] | None = None) -> dict:
    """Ray options that hand this process's fault variables (and the step census's,
    `step_census`) to an actor it starts, beside ``env``: an existing cluster's actors do
    not inherit the driver's environment. What the workers of a Ray this process started
    inherit anyway is left out (`ray_node`). Empty when there is nothing to hand, so the
    controller of a normal run is started as Ray starts any actor."""
    from sft_runtime.runtime.process.step_census import ENV as CENSUS_ENV

    handed = {k: v for k, v in os.environ.items() if k.startswith((ENV, CENSUS_ENV))}
    inherited = inherited_env()  # an embedded Ray's workers have these already
    env = {k: v for k, v in {**(env or {}), **handed}.items() if inherited.get(k) != v}
    return {"runtime_env": {"env_vars": env}} if env else {}

"""The scheduling priority of the processes a run places on Ray.

Ray starts every worker process at niceness 15. On a machine where anything else runs (a
shared node, a data job, two test suites side by side), a process at niceness 15 gets a few
percent of a core against one at niceness 0, so a controller or policy worker left there
makes the whole run crawl, not just slow down. ``cluster.worker_niceness`` (0 by default)
fixes that twice over: an embedded Ray is started with its workers at that niceness (so
their start-up imports run at it too), and each policy worker (in its constructor) and the
controller (when its run begins) moves itself to it, which also covers a cluster someone
else started.

The controller goes a little nicer than that (`controller_niceness`). Its calls are sent
ahead, so the workers never wait on it within a step; but it does its bookkeeping for a step
(the results, the fsynced record, the next calls) just as the workers begin the next one,
and on a machine whose cores the workers fill, it then takes a core from one of them and the
other waits for it at the next collective. Five levels nicer, the workers come first at
that moment, while the controller still gets about a quarter of a core against a busy
process: more than twice the tenth of a core it uses.
"""

from __future__ import annotations

import os
import warnings

RAY_NICENESS_ENV = "RAY_worker_niceness"
"""Read by the raylet when it starts worker processes."""

CONTROLLER_OFFSET = 5
"""How much nicer than the workers the controller runs: at 5, a busy process at the workers'
niceness gets three times the controller's share of a core, so the controller yields when a
step begins but is not starved."""


def controller_niceness(worker_niceness: int | None) -> int | None:
    """The controller's niceness for workers at ``worker_niceness`` (None: leave it at Ray's)."""
    if worker_niceness is None:
        return None
    return min(19, worker_niceness + CONTROLLER_OFFSET)


def embedded_ray_env(target: int | None) -> dict[str, str]:
    """Environment for starting an embedded Ray whose workers begin at ``target``; a value
    the user already exported wins."""
    if target is None or RAY_NICENESS_ENV in os.environ:
        return {}
    return {RAY_NICENESS_ENV: str(target)}


def set_niceness(target: int | None) -> None:
    """Move every thread of this process to ``target`` niceness if allowed (None: leave
    them at Ray's).

    On Linux a niceness belongs to a thread, and a Ray actor runs its methods on threads
    of its own (a threaded actor, or one with concurrency groups), made before its
    constructor runs: changing only the calling thread would leave the thread that trains at
    Ray's value. Threads started later inherit the value from the thread that starts them.
    Lowering a niceness needs privileges: without them the threads stay where they are,
    with a warning that says how to start them lower.
    """
    if target is None:
        return
    current = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        for tid in _threads():
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) != target:
                    os.setpriority(os.PRIO_PROCESS, tid, target)
            except ProcessLookupError:
                pass  # the thread ended meanwhile
    except PermissionError:
        warnings.warn(
            f"cannot change niceness from {current} to {target} (no permission); "
            f"start Ray with {RAY_NICENESS_ENV}={target} in its environment instead",
            stacklevel=2,
        )


def _threads() -> list[int]:
    """Ids of this process's threads (0, the calling thread, where /proc is missing)."""
    try:
        names = os.listdir("/proc/self/task")
    except OSError:
        return [0]
    return [int(name) for name in names if name.isdigit()]

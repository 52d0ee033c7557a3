"""Killing actors and waiting until their processes are gone.

`ray.kill` only asks: the actor's process exits a moment later. A driver that ends in that
moment shuts its embedded Ray down, and the raylet SIGTERMs the worker still standing; Ray's
handler then raises SystemExit in whatever the worker was running, and Python prints it as
a traceback under a run that succeeded. Waiting for the processes this node hosts (the only
ones whose pid means anything here) closes that window. The pid comes from the GCS actor
table, so an actor too stuck to answer a call still has one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import ray

from sft_runtime.runtime.process.liveness import pid_alive

EXIT_WAIT_S = 10.0
_POLL_S = 0.02


def kill_and_wait(actors: Iterable[Any], timeout_s: float = EXIT_WAIT_S) -> None:
    """Kill ``actors`` (no restart) and wait, up to ``timeout_s``, for their local processes
    to exit. Never raises: an actor already gone, or a Ray that cannot say where an actor
    ran, only shortens the wait."""
    actors = list(actors)
    pids = [pid for pid in (_local_pid(a) for a in actors) if pid is not None]
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - an actor already gone is fine
            pass
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if pid_alive(pid, until_reaped=True)]
        if pids:
            time.sleep(_POLL_S)


def _local_pid(actor: Any) -> int | None:
    try:
        from ray._private.state import actors as actor_table

        row = actor_table(actor._actor_id.hex())
        here = ray.get_runtime_context().get_node_id()
        if row.get("State") == "DEAD" or row["Address"]["NodeID"] != here:
            return None
        return int(row["Pid"]) or None
    except Exception:  # noqa: BLE001 - no pid only means no wait
        return None

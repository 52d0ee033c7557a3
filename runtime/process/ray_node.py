"""The Ray node this process started, and the environment its workers inherit from it.

``ray.init()`` without a cluster starts a node of its own with this process's environment,
and every worker that node starts (those it starts ahead of need too) has that environment.
A variable an actor needs that is already there needs no ``runtime_env``: one would make
Ray start that actor a worker process of its own, for the environment's hash, instead of
taking a worker started ahead of need, which then idles (about a core-second a launch on
2 cores, every launch of a run whose faults or census are armed). A cluster this process
joined, or a Ray the embedding program started, has another environment, so what it needs
is handed as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

_started: tuple[Path, dict[str, str]] | None = None  # (its session folder, its environment)


def session_dir() -> Path | None:
    """The session folder of the node this process's Ray started, if it started one."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if node is None:
        return None
    path = node.get_session_dir_path()
    return Path(path) if path else None


def record_started_env(env: Mapping[str, str]) -> None:
    """Called right after ``ray.init`` started a node here, with the environment taken just
    before it: what that node's workers have."""
    global _started
    session = session_dir()
    _started = None if session is None else (session, dict(env))


def inherited_env() -> Mapping[str, str]:
    """What every worker of the Ray this process runs on has from it: the environment it
    was started with when this process started it, else nothing."""
    if _started is None or session_dir() != _started[0]:
        return {}
    return _started[1]

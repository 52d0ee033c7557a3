"""Whether the process that started a run is still there.

Ray reaps a dead driver's actors only after a second or two; a controller that checks at
each step boundary (and before each commit) stops at once instead of training on. Twice a
step is often enough that the check must cost next to nothing: where Linux offers a pidfd,
the driver's is opened once and each check is one ``poll`` that the kernel answers the
moment the process exits (an unreaped zombie included, and never a later process that got
the same pid); elsewhere it is a signal 0 and a read of ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import os
import select
import socket
from typing import Any

_HOST = socket.gethostname()
_watches: dict[int, select.poll | None] = {}  # pid -> a poll on its pidfd (None: no pidfd)


class DriverGone(RuntimeError):
    """The process that started the run is gone; its controller stops with it."""


def driver_identity() -> dict[str, Any]:
    """Recorded by setup (in `train_cluster`) and by the controller (in the run lock)."""
    return {"driver_pid": os.getpid(), "driver_host": _HOST}


def driver_alive(info: dict[str, Any]) -> bool | None:
    """True/False for a driver on this host, None when it cannot be told from here."""
    pid = info.get("driver_pid")
    if not isinstance(pid, int) or info.get("driver_host") != _HOST:
        return None
    return _watched_alive(pid)


def _watched_alive(pid: int) -> bool:
    """`pid_alive` through a pidfd kept open for later checks, where one can be opened."""
    if pid not in _watches:
        _watches[pid] = _open_watch(pid)
    watch = _watches[pid]
    if watch is None:
        return pid_alive(pid)
    return not watch.poll(0)  # readable once the process has exited


def _open_watch(pid: int) -> select.poll | None:
    """A poll on a pidfd of ``pid``: None where there is none to open (not Linux 5.3+, a
    sandbox refusing it) or the pid is gone already (`pid_alive` says so from then on)."""
    try:
        fd = os.pidfd_open(pid)  # type: ignore[attr-defined]  # Linux only
    except (AttributeError, OSError):
        return None
    watch = select.poll()
    watch.register(fd, select.POLLIN)  # the fd stays open with the watch, one per pid
    return watch


def pid_alive(pid: int, *, until_reaped: bool = False) -> bool:
    """A process of this pid runs on this host (one of another user's counts). A zombie,
    killed but not yet reaped, does not, unless ``until_reaped``: a caller that must find
    the pid gone (a teardown whose driver exits next) waits for its parent to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return until_reaped or not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A killed process that its parent has not reaped yet still answers `kill(pid, 0)`."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()  # noqa: SIM115 - one short read
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"Z"


def check_driver(info: dict[str, Any]) -> None:
    if driver_alive(info) is False:
        raise DriverGone(f"the driver (pid {info['driver_pid']}) exited; stopping this run")

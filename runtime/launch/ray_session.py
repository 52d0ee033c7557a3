"""The embedded Ray's session folder goes when the process that started that Ray ends.

``ray.init()`` on a machine without a cluster starts a head node of its own, which keeps
its logs, sockets and spilled objects in ``<tmp>/ray/session_<time>_<pid>`` (``<tmp>`` is
RAY_TMPDIR, else TMPDIR, else /tmp). Ray stops its processes at exit but never removes
that folder, so every run left one behind. `remove_session_at_exit` is called by
`setup.ensure_ray` only after it started such a Ray itself: the folder of a cluster it
joined (``cluster.address``, RAY_ADDRESS), or of a Ray the embedding program started
(tests share one per session), belongs to whoever started it and is never touched.

At exit the hook runs before Ray's own (hooks run in reverse order of registration):
it shuts Ray down, waiting for the processes Ray started, then removes the folder and the
``session_latest`` link when it points there. A process killed outright runs no hook; its
folder stays, as it did before.
"""

from __future__ import annotations

import atexit
import os
import shutil
import time
from pathlib import Path

from sft_runtime.runtime.process.ray_node import session_dir

SESSION_LATEST = "session_latest"
_REMOVE_TRIES = 5  # a worker that is still exiting may write one more log line


def remove_session_at_exit() -> Path | None:
    """Remove the session folder of the Ray this process started when the process exits;
    returns the folder (None when Ray runs no node in this process)."""
    session = session_dir()
    if session is not None:
        atexit.register(_shutdown_and_remove, session)
    return session


def _shutdown_and_remove(session: Path) -> None:
    import ray

    try:
        if ray.is_initialized() and session_dir() == session:
            ray.shutdown(wait_for_processes=True)
    except Exception:  # noqa: BLE001 - an exiting process cannot do more; the folder stays
        return
    remove_session(session)


def remove_session(session: Path) -> None:
    """Delete ``session`` and the ``session_latest`` link beside it that points to it."""
    for _ in range(_REMOVE_TRIES):
        shutil.rmtree(session, ignore_errors=True)
        if not session.exists():
            break
        time.sleep(0.2)
    latest = session.parent / SESSION_LATEST
    try:
        if latest.is_symlink() and Path(os.readlink(latest)) == session:
            latest.unlink()
    except OSError:
        pass  # another Ray replaced the link meanwhile: it is theirs

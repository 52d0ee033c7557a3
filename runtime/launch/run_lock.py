"""The driver's hold on a run directory, from before it reads where to resume until its
controller is gone.

The controller's own lock (``events.lock``) is taken only when it opens the log, after the
driver has read the resume point and built the workers: two launches started together would
both read the same resume point, and the later one would roll back every step the earlier
one committed. So the driver takes ``run.lock`` first, before Ray starts, and keeps it until
its controller has been removed. The kernel drops it when the driver dies, so a killed launch
never blocks the next one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sft_runtime.events.errors import EventLogLocked
from sft_runtime.events.log import acquire_lock, lock_holder
from sft_runtime.runtime.errors import UserInputError

RUN_LOCK_NAME = "run.lock"
_HELD: dict[Path, int] = {}  # run dir -> descriptor, for the launches of this process


@contextmanager
def holding_run(run_dir: Path) -> Iterator[None]:
    """Hold the run directory for one launch; a second launch anywhere is refused at once
    with one line naming the holding driver's pid and host."""
    key = Path(run_dir).resolve()
    if key in _HELD:  # a second launch from another thread of this driver
        raise UserInputError(_refusal(run_dir))
    key.mkdir(parents=True, exist_ok=True)
    try:
        fd = acquire_lock(key / RUN_LOCK_NAME)
    except EventLogLocked:
        raise UserInputError(_refusal(run_dir)) from None
    _HELD[key] = fd
    try:
        yield
    finally:
        del _HELD[key]
        os.close(fd)  # closing the descriptor releases the flock


def held_here(run_dir: Path) -> bool:
    """This process holds the run directory (a launch of `holding_run` is under way)."""
    return Path(run_dir).resolve() in _HELD


def check_not_held(run_dir: Path) -> None:
    """Refuse when another process's launch holds the run directory (for `setup_sft_v2`
    called on its own, by an embedding program that manages its launches itself)."""
    path = Path(run_dir) / RUN_LOCK_NAME
    if held_here(run_dir) or not path.exists():
        return
    try:
        fd = acquire_lock(path)
    except EventLogLocked:
        raise UserInputError(_refusal(run_dir)) from None
    os.close(fd)


def _refusal(run_dir: Path) -> str:
    holder = lock_holder(Path(run_dir) / RUN_LOCK_NAME)
    who = f"driver pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    return (
        f"{run_dir}: another launch is running on this run directory ({who}); "
        "wait for it to end or stop it, or choose another run directory"
    )

"""SIGTERM handled as Ctrl-C, so that a command's cleanup runs when a scheduler ends it.

Python's default SIGTERM ends the process on the spot: no ``finally`` block, no context
manager's exit, so a temporary folder (a whole checkpoint copied for `reproduce`) stays on
disk for ever. Inside `sigterm_interrupts` the first SIGTERM raises `KeyboardInterrupt`
where the main thread is, which the CLI reports as an interruption (exit 130) once every
cleanup on the way out has run; later ones are ignored until the block ends, so a second
signal cannot cut the cleanup short. Code that stops more gently on a signal (the training
driver's own handler) installs its handler inside and restores this one after.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While inside, SIGTERM raises `KeyboardInterrupt` once (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handle(signum: int, frame: Any) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)

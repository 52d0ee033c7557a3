"""SIGTERM handled as Ctrl-C, so that a command's cleanup runs when a scheduler ends it.

Python's default SIGTERM ends the process on the spot: no ``finally`` block, no context
manager's exit, so a temporary folder (a whole checkpoint copied for `reproduce`) stays on
disk for ever. Inside `sigterm_interrupts` the first SIGTERM raises `KeyboardInterrupt`
where the main thread is, which the CLI reports as an interruption (exit 130) once every
cleanup on the way out has run; later ones are ignored until the block ends, so a second
signal cannot cut the cleanup short. Code that stops more gently on a signal (the training
driver's own handler) installs its handler inside and restores this one after.

Where the main thread is may be a callback whose exceptions Python prints and drops: a
weakref's callback (the import system's module locks have one), a ``__del__``. The
interruption raised there would be lost, and the command would run on to its end as if no
signal had come; a scheduler's SIGKILL after its grace period would then leave what the
cleanup was for. Such a drop goes through `sys.unraisablehook`, so while inside the block a
hook that sees its own interruption dropped has the signal delivered again, from a thread of
its own (a signal sent from the hook is handled inside the hook, and dropped with it).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While inside, SIGTERM raises `KeyboardInterrupt` once (main thread only), and again
    if a callback dropped it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: KeyboardInterrupt | None = None  # the interruption on its way out, if any

    def handle(signum: int, frame: Any) -> None:
        nonlocal raised
        if raised is None:
            raised = KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
            raise raised

    def dropped(unraisable: Any) -> None:
        nonlocal raised
        if raised is None or unraisable.exc_value is not raised:
            old_hook(unraisable)
            return
        raised = None
        returned = threading.Event()
        _signal_main_thread_after(returned)
        returned.set()  # the hook's last act: what is raised from here on is not dropped

    old_hook = sys.unraisablehook
    old = signal.signal(signal.SIGTERM, handle)
    sys.unraisablehook = dropped
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        sys.unraisablehook = old_hook


def _signal_main_thread_after(returned: threading.Event) -> None:
    """SIGTERM for the main thread once ``returned`` is set, sent from a thread of its own.
    Should it still land inside the hook, the drop is caught again and another is sent."""
    main = threading.main_thread().ident
    assert main is not None

    def send() -> None:
        returned.wait()
        signal.pthread_kill(main, signal.SIGTERM)

    threading.Thread(target=send, name="sigterm-again", daemon=True).start()

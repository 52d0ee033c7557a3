"""`sigterm_interrupts`: a SIGTERM is one `KeyboardInterrupt` in the main thread, even when
it lands in a callback whose exceptions Python drops."""

from __future__ import annotations

import signal
import sys
import threading
import weakref

import pytest

from sft_runtime.runtime.process.terminate import sigterm_interrupts

WAIT_BOUND_S = 60.0  # a lost signal fails the test here, instead of hanging it


class _Object:
    pass


def _signal_inside_a_weakref_callback(reached: list[str]) -> None:
    """The SIGTERM's handler runs inside a weakref's callback, as it may when a signal comes
    while the import system drops a module lock."""

    def callback(_ref: weakref.ref) -> None:
        signal.raise_signal(signal.SIGTERM)
        reached.append("callback went on")  # the handler ran before this line: not reached

    obj = _Object()
    ref = weakref.ref(obj, callback)
    del obj  # the callback runs here
    reached.append(f"after the callback ({ref() is None})")


def test_a_sigterm_raises_keyboard_interrupt_once_then_is_ignored():
    seen = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), sigterm_interrupts():
        try:
            signal.raise_signal(signal.SIGTERM)
            seen.append("not interrupted")
        finally:
            signal.raise_signal(signal.SIGTERM)  # during the cleanup: ignored
            seen.append("cleanup done")
    assert seen == ["cleanup done"]
    assert signal.getsignal(signal.SIGTERM) is before  # put back


def test_a_sigterm_dropped_by_a_callback_is_raised_again_after_it(capsys):
    reached: list[str] = []
    hook = sys.unraisablehook
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), sigterm_interrupts():
        _signal_inside_a_weakref_callback(reached)
        # what the command does next is interrupted; a lost signal lets it run to its end
        waited_out = threading.Event().wait(WAIT_BOUND_S)
        reached.append(f"not interrupted (waited out: {waited_out})")
    assert reached in ([], ["after the callback (True)"]), reached
    assert sys.unraisablehook is hook  # put back
    assert "Exception ignored" not in capsys.readouterr().err


def test_another_dropped_exception_still_reaches_the_previous_hook():
    seen = []

    def callback(_ref: weakref.ref) -> None:
        raise ValueError("a callback's own error")

    old = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: seen.append(unraisable.exc_value)
    try:
        with sigterm_interrupts():
            obj = _Object()
            ref = weakref.ref(obj, callback)
            del obj
        assert ref() is None
    finally:
        sys.unraisablehook = old
    assert [type(e) for e in seen] == [ValueError]

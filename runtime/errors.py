"""Error types shared by the runtime.

The CLI maps `UserInputError` (and its subclasses) to exit code 2, so anything raised
because a user's config, data set, arguments or files are wrong should derive from it
and name the key, file or line in its message. It is a `ValueError`, as bad input is in the
reference and in pydantic, so embedding code that catches ``ValueError`` keeps working.
`quietly` is the other half of the error policy: a cleanup step never hides the original
error, its own failure becomes a warning.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any


class UserInputError(ValueError):
    """Bad input from the user: a config value, an argument, a file. CLI exit code 2."""


class PeerStepError(RuntimeError):
    """This rank's step failed only because another data-parallel rank's did.

    Reports of a failed fan-out name the ranks whose own errors caused it first, and judge
    whether the failure was bad input by those alone.
    """


def quietly(what: str, fn: Callable[[], Any]) -> None:
    """Run a cleanup step; if it fails, warn (naming the step) and carry on."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        warnings.warn(
            f"could not {what}: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2
        )


class RunFailure(RuntimeError):
    """A run failure that its one line explains (a diverged step, a full disk): the CLI prints
    the line and exits 1 with no traceback, and the driver raises it as itself, not inside
    Ray's wrapper. What was saved stands; the message says how to go on."""


class DivergedError(RunFailure):
    """A step's loss or gradient norm was not finite: its update was not applied."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None):
        where = (
            f"resume goes on from checkpoint step_{last_checkpoint}"
            if last_checkpoint is not None
            else "no checkpoint was saved yet, so a new attempt starts from step 1"
        )
        super().__init__(
            f"step {step} diverged (loss {loss}, grad_norm {grad_norm}): its update was not "
            f"applied and the run stopped; {where}. Run the same command with a smaller "
            "policy.optimizer.kwargs.lr, or set sft.skip_nonfinite_steps=true to skip such steps"
        )
        self.step, self.loss, self.grad_norm = step, loss, grad_norm

    def __reduce__(self):  # crosses Ray as itself
        return (_diverged, (self.step, self.loss, self.grad_norm, self.args[0]))


def _diverged(step: int, loss: float, grad_norm: float, message: str) -> DivergedError:
    err = DivergedError.__new__(DivergedError)
    RuntimeError.__init__(err, message)
    err.step, err.loss, err.grad_norm = step, loss, grad_norm
    return err


class DiskFullError(RunFailure, OSError):
    """The operating system refused a write for want of space (ENOSPC) or quota (EDQUOT).

    A run failure (CLI exit 1), not bad input: the config was fine, the disk was not. It is
    an `OSError` too, with the refused ``errno``, so embedding code that catches ``OSError``
    keeps working. ``what`` names what was being written; ``resume_step`` is the step the
    same command resumes from (None where the caller does not know it). It crosses Ray as
    itself, and its message is one line.
    """

    errno: int  # OSError's may be None; this one is always the refused write's
    strerror: str

    def __init__(self, code: int, what: str, resume_step: int | None = None) -> None:
        super().__init__(code, what, resume_step)
        self.errno, self.strerror = code, os.strerror(code)
        self.what, self.resume_step = what, resume_step

    def __str__(self) -> str:
        if self.resume_step is None:
            then = "free space and run the same command again"
        elif self.resume_step == 0:
            then = "free space and run the same command to start again (no checkpoint was saved)"
        else:
            then = f"free space and run the same command to resume from step {self.resume_step}"
        return f"{self.strerror.lower()} writing {self.what}; {then}"

    def __reduce__(self):  # crosses Ray as itself
        return (type(self), (self.errno, self.what, self.resume_step))

"""Error types shared by the runtime.

The CLI maps `UserInputError` (and its subclasses) to exit code 2, so anything raised
because a user's config, data set, arguments or files are wrong should derive from it
and name the key, file or line in its message. It is a `ValueError`, as bad input is in the
reference and in pydantic, so embedding code that catches ``ValueError`` keeps working.
`quietly` is the other half of the error policy: a cleanup step never hides the original
error, its own failure becomes a warning.
"""

from __future__ import annotations

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

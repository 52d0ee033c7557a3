"""Cleanup that never hides the original error: failures become warnings."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any


def quietly(what: str, fn: Callable[[], Any]) -> None:
    """Run a cleanup step; if it fails, warn (naming the step) and carry on."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        warnings.warn(
            f"could not {what}: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2
        )

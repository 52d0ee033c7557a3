"""Checks of a path given as a run directory, made before a command reads or creates anything.

A run directory that is a file (or lies inside one), or one that must exist and does not, is
bad input: one line naming the path (exit 2), instead of a traceback from whatever first
touches it (``mkdir`` in a Ray actor, a log read) or a message about something inside it.
"""

from __future__ import annotations

from pathlib import Path

from sft_runtime.runtime.errors import UserInputError


def require_run_dir(path: Path | str) -> Path:
    """``path``, an existing directory to read a run from; else `UserInputError`."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.exists():
        raise UserInputError(f"{path}: a file, not a run directory")
    raise UserInputError(f"{path}: no such run directory")


def check_dir_to_create(path: Path | str, key: str) -> None:
    """``path`` is a directory, or can be made one: the nearest part of it that exists is a
    directory. ``key`` names where the path came from (``--run-dir``, ``logger.log_dir``)."""
    path = Path(path)
    for part in (path, *path.parents):
        if part.is_dir():
            return
        if part.exists():
            where = "a file" if part == path else f"{part} is a file"
            raise UserInputError(f"{key} '{path}': {where}, not a directory")

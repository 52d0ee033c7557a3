"""Errors of the event log. Each names the file and, where it applies, the 1-based line."""

from __future__ import annotations

from pathlib import Path


class EventLogError(Exception):
    """Base class: something is wrong with an event log or how it is used."""


class EventLogCorrupted(EventLogError):
    """A record that cannot be trusted: bad JSON, a broken chain, a gap, an unknown type."""

    def __init__(self, path: Path | str, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path} line {line}: {reason}")


class LineageError(EventLogCorrupted):
    """Records that are each intact but tell an impossible story (a step skipped, say)."""


class EventLogLocked(EventLogError):
    """Another process is writing this run directory's log."""

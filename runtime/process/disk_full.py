"""Tell a full disk apart from other failures, wherever in a chain of errors it hides.

The write that fails for want of space is rarely the error that reaches the user: a
worker's ``os.write`` is wrapped by Ray (`RayTaskError`, whose ``cause`` is the original),
by the worker group (`PolicyWorkerError`, whose ``__cause__`` is Ray's error), by the
checkpoint (`CheckpointWriteError`), and by Ray again on the way from the controller to the
driver, where pickling drops ``__cause__``. So the controller, which still holds the whole
chain, and the driver each look through it for an ``OSError`` with ``ENOSPC`` or ``EDQUOT``
and raise a `DiskFullError` (one line, exit 1) in its place. No ray import: the walk reads
the ``cause`` attribute that Ray's wrappers carry.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

from sft_runtime.runtime.errors import DiskFullError

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_MAX_CHAIN = 64  # a chain is a handful of errors; this only guards against a cycle


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything it wraps (Ray's ``cause``, ``__cause__``, ``__context__``),
    outermost first, each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < _MAX_CHAIN:
        err = todo.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        cause = getattr(err, "cause", None)
        todo += [cause if isinstance(cause, BaseException) else None]
        todo += [err.__cause__, err.__context__]


def disk_full_error(
    exc: BaseException, *, where: Path | str | None = None, resume_step: int | None = None
) -> DiskFullError | None:
    """The `DiskFullError` ``exc`` amounts to, or None when no write in its chain was
    refused for space or quota.

    What was being written is, in this order: what an error in the chain says it wrote (a
    ``written`` attribute, as `CheckpointWriteError` has), the refused file's name, or
    ``where``. A `DiskFullError` already in the chain is kept, with ``resume_step`` filled
    in when it had none.
    """
    chain = list(error_chain(exc))
    for err in chain:
        if isinstance(err, DiskFullError):
            step = err.resume_step if err.resume_step is not None else resume_step
            return DiskFullError(err.errno, err.what, step)
    refused = next((e for e in chain if isinstance(e, OSError) and e.errno in FULL_ERRNOS), None)
    if refused is None:
        return None
    written = next((e.written for e in chain if isinstance(getattr(e, "written", None), str)), None)
    what = written or _filename(refused) or (str(where) if where is not None else "a file")
    return DiskFullError(refused.errno, what, resume_step)


def _filename(err: OSError) -> str | None:
    name = err.filename
    return None if name is None else str(name)

"""`RunIdGenerator`: span and trace ids seeded from the OS's entropy, and ids reserved ahead.

The SDK's default generator draws from Python's global `random`, which training seeds (and a
checkpoint restores): every run of one config would reuse the same ids, and a backend that
keys spans by id keeps one run's and silently drops the other's; each span would also move
the RNG stream the checkpoints save. Ids here come from a generator of this module's own,
seeded from ``os.urandom`` in each process (again in a forked child): it shares no state
with training, and an id costs a tenth of a microsecond where a read of the OS's entropy
costs about ten on these machines.

`reserve` hands out the ids of a span before the span exists: a step's worker calls are sent
(and carry their parent's id) before the step's root can know when its first piece of work
began, so the root is created later, with the reserved ids and its true start time (`use`).

Imported only where the SDK is installed (`traces.setup`); it needs the SDK.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.sdk.trace.id_generator import IdGenerator

_ids = random.Random(os.urandom(32))


def _reseed() -> None:
    _ids.seed(os.urandom(32))  # a forked child must not repeat its parent's ids


os.register_at_fork(after_in_child=_reseed)


def _nonzero(nbytes: int) -> int:
    bits = nbytes * 8
    while True:  # zero is the invalid id
        value = _ids.getrandbits(bits)
        if value:
            return value


class RunIdGenerator(IdGenerator):
    """Random ids, seeded from ``os.urandom``; the next span of a thread may take reserved
    ones."""

    def __init__(self) -> None:
        self._next = threading.local()

    def generate_trace_id(self) -> int:
        reserved = getattr(self._next, "ids", None)
        return reserved[0] if reserved is not None else _nonzero(16)

    def generate_span_id(self) -> int:
        reserved = getattr(self._next, "ids", None)
        if reserved is not None:
            self._next.ids = None  # one span only
            return reserved[1]
        return _nonzero(8)

    def is_trace_id_random(self) -> bool:
        return True

    @staticmethod
    def reserve() -> tuple[int, int]:
        """(trace id, span id) for a root span to be started later with `use`."""
        return _nonzero(16), _nonzero(8)

    @contextmanager
    def use(self, ids: tuple[int, int]) -> Iterator[None]:
        """The next root span started on this thread gets ``ids``."""
        self._next.ids = ids
        try:
            yield
        finally:
            self._next.ids = None

"""`PrefetchingLoader`: read the next batches ahead of the step that needs them, exactly.

Two ways to read ahead, chosen when the loader is built:

- ``background=True`` (``data_plane.max_partitions = depth >= 2``): a thread fetches up to
  ``depth`` batches ahead, so a loading-heavy step (a chat template rendered in Python) finds
  its batch ready; the loader's latency overlaps the previous step's training.
- ``background=False`` (``data_plane.load_during_allreduce``, depth 2): no thread. The worker
  calls `fetch_now` while its gradient all-reduce is in flight, the one stretch of a step in
  which its own thread only waits for the other ranks. The next step's `load()` then takes a
  batch already in hand, and the fetch's CPU never competes with a forward or backward pass.
  `load()` with nothing queued (the first step, after an abort) fetches in place.

Why it is exact. A fetch never commits anything. It only calls
`ColocatedLoader.fetch_ahead()`, which returns a batch together with the energon state taken
just before that batch was fetched, and queues the pair. The inner loader's counters (steps,
samples, epochs) move only when the controller commits:

- `load()` takes the oldest queued batch and makes it the inner loader's active batch with
  its own state (`activate_fetched`), so the envelope, `active_batch`, and the epoch/step
  index are the ones a plain `load()` would give. Queued batches are never visible before.
- `commit()` is the inner commit: counters advance by exactly that batch.
- `abort()` stops the thread, drops every queued batch, and lets the inner loader rewind to
  the state before the active batch (energon is rebuilt from it), which is also the state
  before every batch fetched after it. The next `load()` delivers the same batches again.
- `state_dict()` (refused while a batch is active, like the inner one) returns the inner
  loader's state with the energon position before the OLDEST queued batch, or energon's
  current position when nothing is queued: the state after the last committed batch, never
  counting read-ahead. Restoring it into a fresh loader re-delivers the queued batches.

Threads. energon objects are touched by one thread at a time: the background thread while it
fetches (``_busy``), the caller's thread only for `setup`, `abort`, `close` and a
`state_dict` with nothing queued, which first pause the fetcher and wait until its current
fetch ends. `load`, `commit` and a `state_dict` with a batch queued only move Python objects
under the lock. energon is not thread-safe even across loaders: while a loader iterates it
keeps its `WorkerConfig` in a process-global class variable
(``WorkerConfig.active_worker_config``, which the task encoder's packing seed also reads), so
every energon call made here also holds the process-wide `ENERGON_LOCK`. Code that drives a
plain `ColocatedLoader` in a process where a `PrefetchingLoader` runs must hold it too.
With ``num_workers=0`` energon runs the task encoder in the fetching thread; it builds tensors
but does no math on the model, so training numerics (which run in the caller's thread with its
torch settings) are unchanged.

Memory: at most ``depth`` batches are held at once: the active one, the queued ones and the
one being fetched.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sft_runtime.runtime.data.batch import SFTBatch, StepEnvelope

CLOSE_JOIN_TIMEOUT_S = 60.0
ENERGON_LOCK = threading.RLock()
"""Held around every energon call of every `PrefetchingLoader` in this process (see above)."""


@dataclass
class _Fetched:
    state_before: Any  # energon state taken just before this batch was fetched
    batch: SFTBatch


class PrefetchingLoader:
    """A `BatchSource` that keeps up to ``depth`` batches (active + read ahead) in hand.

    ``inner_factory()`` builds the loader to wrap: a `ColocatedLoader` or anything with its
    `fetch_ahead`, `activate_fetched`, `state_dict_at` extension. ``background`` reads ahead
    in a thread; without it only `fetch_now` (and a `load` with nothing queued) fetches.
    """

    def __init__(
        self, inner_factory: Callable[[], Any], depth: int = 2, *, background: bool = True
    ) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.depth = depth
        self.background = background
        self._set_up = False
        self._inner = inner_factory()
        self._cond = threading.Condition()
        self._ready: deque[_Fetched] = deque()
        self._active = False
        self._busy = False  # the fetcher is inside energon
        self._paused = 0  # the caller's thread is using energon
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        # seconds of the latest background fetches (diagnostics, bounded)
        self.fetch_seconds: deque[float] = deque(maxlen=1024)

    @property
    def inner(self) -> Any:
        return self._inner

    def fingerprint(self) -> dict:
        return self._inner.fingerprint()

    # -- lifecycle --------------------------------------------------------------------------

    def setup(self, restored_state: Any = None) -> None:
        if self._set_up:
            raise RuntimeError("setup() was already called on this loader")
        with ENERGON_LOCK:
            self._inner.setup(restored_state)
        self._set_up = True
        if not self.background:
            return
        name = f"sft-prefetch-rank{getattr(self._inner, 'logical_rank', '?')}"
        self._thread = threading.Thread(target=self._fetch_loop, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the fetcher, drop read-ahead, release the inner loader. Safe to call twice."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_JOIN_TIMEOUT_S)
            if thread.is_alive():
                warnings.warn(
                    f"{thread.name} still fetching after {CLOSE_JOIN_TIMEOUT_S:g}s; closing anyway",
                    RuntimeWarning,
                    stacklevel=2,
                )
        with self._cond:
            self._ready.clear()
            self._active = False
        with ENERGON_LOCK:
            self._inner.close()

    # -- the background fetcher -------------------------------------------------------------

    def _wants_fetch(self) -> bool:
        held = len(self._ready) + int(self._active)
        return not self._paused and self._error is None and held < self.depth

    def _fetch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._wants_fetch():
                    self._cond.wait()
                if self._closed:
                    return
                self._busy = True
            self._fetch_one(BaseException)

    def _fetch_one(self, catch: type[BaseException]) -> None:
        """One batch read ahead and queued (the caller set ``_busy``); a failure is handed to
        the next load(), in stream order."""
        item, error = None, None
        start = time.perf_counter()
        try:
            with ENERGON_LOCK:
                state_before, batch = self._inner.fetch_ahead()
            item = _Fetched(state_before, batch)
        except catch as exc:  # noqa: BLE001 - raised by the next load()
            error = exc
        seconds = time.perf_counter() - start
        with self._cond:
            self._busy = False
            if item is not None:
                self._ready.append(item)
                self.fetch_seconds.append(seconds)
            else:
                self._error = error
            self._cond.notify_all()

    def fetch_now(self) -> None:
        """Read one batch ahead in the caller's thread, when there is room (no-op with a
        background fetcher, which reads ahead on its own)."""
        if self.background:
            return
        with self._cond:
            if self._closed or not self._set_up or not self._wants_fetch():
                return
            self._busy = True
        self._fetch_one(Exception)

    def _pause(self) -> None:
        """Keep the fetcher out of energon until `_resume` (waits for a fetch in flight)."""
        with self._cond:
            self._paused += 1
            while self._busy:
                self._cond.wait()

    def _resume(self) -> None:
        with self._cond:
            self._paused -= 1
            self._cond.notify_all()

    def _require_running(self) -> None:
        if not self._set_up or self._closed:
            raise RuntimeError("the loader is not set up (call setup() first) or was closed")

    # -- steps ------------------------------------------------------------------------------

    def load(self) -> StepEnvelope:
        """Hand out the oldest batch read ahead (waiting for it if needed).

        ``load_seconds`` in the envelope is the time this call waited, which is what the
        step paid for loading; a failed read-ahead is raised here, in stream order.
        """
        self._require_running()
        start = time.perf_counter()
        with self._cond:
            if self._active:
                raise RuntimeError("a batch is already active: commit() or abort() it first")
            if not self.background and not self._ready and self._error is None:
                self.fetch_now()  # nothing was read ahead: fetch here, as a plain load would
            while not self._ready and self._error is None:
                if not self._thread.is_alive():
                    raise RuntimeError("the prefetch thread is gone (the loader was closed?)")
                self._cond.wait(timeout=1.0)
            if not self._ready:
                error, self._error = self._error, None
                self._cond.notify_all()  # the fetcher continues from where energon stands
                raise error
            item = self._ready.popleft()
            envelope = self._inner.activate_fetched(
                item.state_before, item.batch, time.perf_counter() - start
            )
            self._active = True
            return envelope

    @property
    def active_batch(self) -> SFTBatch:
        return self._inner.active_batch

    def commit(self) -> None:
        """Accept the active batch (the inner loader counts it); read-ahead may continue."""
        with self._cond:
            self._inner.commit()
            self._active = False
            self._cond.notify_all()

    def abort(self) -> None:
        """Drop the active batch and everything read after it; the next loads re-deliver them.

        Without an active batch this does nothing: the batches read ahead are still exactly
        the next ones of the stream.
        """
        if not self._active:
            return
        self._pause()
        try:
            with self._cond:
                self._ready.clear()
                self._error = None
                self._active = False
            with ENERGON_LOCK:
                self._inner.abort()  # rewinds energon to the state before the active batch
        finally:
            self._resume()

    def state_dict(self) -> dict:
        """The state after the last committed batch, ignoring read-ahead (see module doc).

        With a batch queued its recorded state is the answer, and the fetcher need not stop:
        a checkpoint does not wait for the batch being read behind it. Only with nothing
        queued does energon's own position count, read with the fetcher paused."""
        self._require_running()
        if self._active:
            raise RuntimeError("cannot save the loader state while a batch is active")
        state = self._queued_state()
        if state is not None:
            return state
        self._pause()
        try:
            state = self._queued_state()  # the fetch we waited for may have queued one
            if state is not None:
                return state
            with ENERGON_LOCK:
                return self._inner.state_dict()
        finally:
            self._resume()

    def _queued_state(self) -> dict | None:
        with self._cond:
            oldest = self._ready[0] if self._ready else None
        if oldest is None:
            return None
        # a copy: energon's restore_state_rank mutates the state it is given, and the queued
        # one is still needed to rewind if this batch is aborted later; only this thread
        # takes queued batches off, so the oldest stays while it is copied
        return self._inner.state_dict_at(copy.deepcopy(oldest.state_before))

    # -- diagnostics ------------------------------------------------------------------------

    def held(self) -> int:
        """Batches in hand now: active + read ahead (tests and benchmarks)."""
        with self._cond:
            return len(self._ready) + int(self._active) + int(self._busy)

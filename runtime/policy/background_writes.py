"""Checkpoint files written by a thread of the worker while the next steps train.

A worker's share of a checkpoint (weights, AdamW state, RNG, the model's config and
tokenizer) takes tens of milliseconds to serialise and write even for a small model, and the
step queued behind the save would wait for all of it. Instead the worker takes a copy of
what the files hold (the values the synchronous write would see, so the files hold the
same values) and hands the writing to one writer thread; the controller learns that the
files are durable from a second call (`checkpoint_written`), served by another of the
actor's threads, so it never queues behind a step. The controller commits the directory
only after every rank has answered that call, so the checkpoint protocol is unchanged: a
crash before then leaves a ``tmp_step_N`` that is never taken for a checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Write = Callable[[], list[str]]  # writes some files, returns their paths


class BackgroundWrites:
    """Checkpoint writes by key (the checkpoint's weights folder), run one after another."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._results: dict[str, Future] = {}
        self._changed = threading.Condition()

    def submit(self, key: str, writes: list[Write], result: dict[str, Any]) -> None:
        """Run `writes` in the writer thread; `wait(key)` returns `result` with their files."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._publish(key, self._pool.submit(_run, writes, result))

    def failed(self, key: str, error: BaseException) -> None:
        """The checkpoint could not even be handed over: `wait(key)` raises `error`."""
        future: Future = Future()
        future.set_exception(error)
        self._publish(key, future)

    def wait(self, key: str) -> dict[str, Any]:
        """The result once the files of `key` are written and fsynced (the write's error
        otherwise). The handing over may not have happened yet: it is another call."""
        with self._changed:
            self._changed.wait_for(lambda: key in self._results)
            future = self._results.pop(key)
        return future.result()

    def _publish(self, key: str, future: Future) -> None:
        with self._changed:
            self._results[key] = future
            self._changed.notify_all()


def _run(writes: list[Write], result: dict[str, Any]) -> dict[str, Any]:
    files: list[str] = []
    for write in writes:
        files.extend(write())
    return {**result, "files": files}

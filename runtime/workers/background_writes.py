"""Checkpoint files written by a thread of the worker while the next steps train.

A worker's share of a checkpoint (weights, AdamW state, RNG, the model's config and
tokenizer) takes tens of milliseconds to serialise and write even for a small model, and the
step queued behind the save would wait for all of it. Instead one writer thread copies what
the files hold and writes them while the next step trains; the controller learns that the
files are written from a second call (`checkpoint_written`), served by another of the
actor's threads, so it never queues behind a step. The controller fsyncs and commits the
directory only after every rank has answered that call, so the checkpoint protocol is
unchanged: a crash before then leaves a ``tmp_step_N`` that is never taken for a checkpoint.

The copies are taken in the writer thread too, while the next step loads and runs its
forward and backward: those read the weights and the optimizer state but never change them.
Whatever does change them (the optimizer step, a load) calls `wait_copied` first, so the
files hold exactly the values a synchronous save would have written. The RNG, which a
forward does move, is captured before the call returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

Write = Callable[[], list[str]]  # writes some files, returns their paths


class BackgroundWrites:
    """Checkpoint writes by key (the checkpoint's weights folder), run one after another."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._results: dict[str, Future] = {}
        self._changed = threading.Condition()
        self._uncopied = 0  # submitted checkpoints whose copies are not taken yet

    def submit(
        self,
        key: str,
        writes: list[Write],
        result: dict[str, Any],
        copy: Callable[[], None] | None = None,
    ) -> None:
        """Run `copy` (it takes the values the writes hold) and then `writes` in the writer
        thread; `wait(key)` returns `result` with their files."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        if copy is not None:
            with self._changed:
                self._uncopied += 1
        self._publish(key, self._pool.submit(self._run, writes, result, copy))

    def wait_copied(self) -> None:
        """Return once every submitted checkpoint has taken its copies: call it before
        changing what a checkpoint holds (weights, optimizer state)."""
        with self._changed:
            self._changed.wait_for(lambda: self._uncopied == 0)

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

    def _run(
        self, writes: list[Write], result: dict[str, Any], copy: Callable[[], None] | None
    ) -> dict[str, Any]:
        if copy is not None:
            try:
                copy()
            finally:  # a failed copy fails the checkpoint, not the step waiting for it
                with self._changed:
                    self._uncopied -= 1
                    self._changed.notify_all()
        files: list[str] = []
        for write in writes:
            files.extend(write())
        return {**result, "files": files}


class Copies:
    """The values a checkpoint's writes hold, by name: copied all at once by `take` (in the
    writer thread, before the writes, into `staging`), or else each read when its write
    asks for it."""

    def __init__(self, staging: Staging | None = None) -> None:
        self._staging = staging if staging is not None else Staging()
        self._read: dict[str, Callable[[], Any]] = {}
        self._taken: dict[str, Any] = {}

    def add(self, name: str, read: Callable[[], Any]) -> Callable[[], Any]:
        """Register how to read ``name`` (tensors may be the live ones: `take` copies them);
        returns what a write calls for its value."""
        self._read[name] = read
        return lambda: self._taken.pop(name) if name in self._taken else read()

    def take(self) -> None:
        for name, read in self._read.items():
            self._taken[name] = self._staging.copy(name, read())

    def __bool__(self) -> bool:
        return bool(self._read)


class Staging:
    """Host buffers a checkpoint's tensors are copied into, kept for the next checkpoint.

    Copying into fresh memory pays a page fault per page, and on a VM that is most of the
    copy: 6 MB took 2.2 ms into new tensors and 0.1 ms into reused ones. So the buffers
    stay, one per tensor of what this rank writes (by name and place in the nested dicts
    and lists), as torchtitan keeps its staging buffers for asynchronous saves. The host
    memory a checkpoint needs at its peak is the same; it is now held between checkpoints.
    A checkpoint's writes finish before the next one copies (one writer thread)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, Any] = {}

    def copy(self, name: str, value: Any) -> Any:
        """``value`` with every tensor replaced by a contiguous CPU copy in a kept buffer;
        buffers of ``name`` that this value no longer has are dropped."""
        used: set[tuple] = set()
        copied = self._copy(value, (name,), used)
        for key in [k for k in self._buffers if k[0] == name and k not in used]:
            del self._buffers[key]
        return copied

    def _copy(self, value: Any, key: tuple, used: set[tuple]) -> Any:
        if isinstance(value, torch.Tensor):
            source = value.detach()
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = self._buffers[key] = torch.empty(source.shape, dtype=source.dtype)
            used.add(key)
            return buffer.copy_(source)
        if isinstance(value, dict):
            return {k: self._copy(v, (*key, k), used) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(v, (*key, i), used) for i, v in enumerate(value)]
        return value

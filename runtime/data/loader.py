"""The colocated loader: one energon loader per logical DP rank, living in the worker.

The batch never leaves the worker; `load()` returns only a `StepEnvelope`. The loader keeps two
energon states: the one taken just before the active batch was fetched (`abort()` restores it
into a fresh energon loader, because energon cannot rewind a loader in place, so the next
`load()` delivers exactly the same samples) and, implicitly, the current one after a `commit()`
(what `state_dict()` returns). Every saved state carries a fingerprint of everything that
shapes the sample stream; restoring under a different setting fails with the list of changes
instead of silently training on a different stream.

Epochs: energon delivers one endless, seeded, repeated stream per rank; a virtual epoch is
``virtual_epoch_length`` consecutive committed batches of it (`StepEnvelope.extra["epoch"]`).
energon's own epochizing is not used because, with worker processes, a loader restored mid
epoch rotates the worker order after its next epoch boundary, which breaks exact resume.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_runtime.runtime.data.batch import SFTBatch, StepEnvelope
from sft_runtime.runtime.data.chat_format import prompt_digest, row_format_fingerprint
from sft_runtime.runtime.data.config import LoaderSpec
from sft_runtime.runtime.data.energon_release import release_energon_loader
from sft_runtime.runtime.data.integrity import (
    DataSetError,
    check_enough_samples,
    explain_load_error,
    refused_sample_error,
)
from sft_runtime.runtime.data.quiet_progress import quiet_progress_bars
from sft_runtime.runtime.data.tokenizer import build_tokenizer
from sft_runtime.runtime.errors import UserInputError

STATE_FORMAT = "sft_v2_colocated_loader"
STATE_VERSION = 1
FIELD_NAMES = ["input_ids", "loss_mask", "position_ids", "segment_ids", "cu_seqlens"]


class LoaderStateMismatchError(UserInputError):
    """A saved loader state was taken under different settings than the loader restoring it."""


def _dataset_uuid(path: Path) -> str | None:
    try:
        return (path / ".nv-meta" / "index.uuid").read_text().strip()
    except OSError:
        return None


# Recorded, not compared: the data set's identity (its ``dataset_uuid`` here, its content
# before Ray in runtime/resume/config_change.py), not its path, decides, so a data set
# moved or copied elsewhere resumes.
UNCOMPARED = frozenset({"data_path"})


def check_fingerprint(saved: dict, current: dict) -> None:
    """Raise `LoaderStateMismatchError` listing every setting that differs (old -> new)."""
    keys = sorted((set(saved) | set(current)) - UNCOMPARED)
    changes = [
        f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
        for key in keys
        if saved.get(key) != current.get(key)
    ]
    if changes:
        raise LoaderStateMismatchError(
            "cannot restore the data loader state, settings changed since it was saved: "
            + "; ".join(changes)
        )


class ColocatedLoader:
    """One logical DP rank's energon loader with load / commit / abort (see module docstring)."""

    def __init__(
        self,
        spec: LoaderSpec,
        logical_rank: int,
        logical_world_size: int,
        placement_hash: str,
    ) -> None:
        if logical_world_size < 1 or not 0 <= logical_rank < logical_world_size:
            raise ValueError(
                f"logical_rank {logical_rank} out of range for world size {logical_world_size}"
            )
        self.spec = spec
        self.logical_rank = logical_rank
        self.logical_world_size = logical_world_size
        self.placement_hash = placement_hash
        self._data_path = Path(spec.data_path).resolve()
        self._tokenizer = build_tokenizer(spec.tokenizer)
        self._loader: Any = None
        self._iter: Any = None
        self._active: SFTBatch | None = None
        self._state_before_active: Any = None
        self._committed_steps = 0
        self._committed_samples = 0
        self._fingerprint: dict | None = None

    # -- identity ---------------------------------------------------------------------------

    @property
    def pad_id(self) -> int:
        """The token that pads this loader's rows (a shard group pads to its widest shard)."""
        return self._tokenizer.pad_id

    def fingerprint(self) -> dict:
        """Everything that must match for a saved state to mean the same sample stream."""
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return dict(self._fingerprint)

    def _compute_fingerprint(self) -> dict:
        spec = self.spec
        return {
            "data_path": str(self._data_path),
            "dataset_uuid": _dataset_uuid(self._data_path),
            "split": spec.split,
            "batch_size": spec.batch_size,
            "seed": spec.seed,
            "shuffle_buffer_size": spec.shuffle_buffer_size,
            "num_workers": spec.num_workers,
            "virtual_epoch_length": spec.virtual_epoch_length,
            "logical_rank": self.logical_rank,
            "logical_world_size": self.logical_world_size,
            "placement_hash": self.placement_hash,
            "packing_algorithm": spec.packing_algorithm,
            "max_sequences_per_bin": spec.max_sequences_per_bin,
            "max_input_seq_length": spec.max_input_seq_length,
            "pad_multiple": spec.pad_multiple,
            "only_unmask_final": spec.only_unmask_final,
            "tokenizer": self._tokenizer.identity(),
            # only where it shapes the rows, so fingerprints of other runs stay what they were
            **(
                {"balanced_knapsack_delta": spec.balanced_knapsack_delta}
                if spec.packing_algorithm == "balanced_greedy_knapsack"
                else {}
            ),
            # a saved state of a run before this key existed cut and trained overlong samples;
            # skip_bad_samples is left out: a refused sample holds its place either way
            **({} if spec.overlong_samples == "truncate" else {"overlong": spec.overlong_samples}),
            # the keys below are newer: named only where they change the stream or its rows
            **({} if spec.shuffle else {"shuffle": False}),
            **row_format_fingerprint(self._tokenizer, spec.chat_format),
            **({} if spec.prompt is None else {"prompt": prompt_digest(spec.prompt)}),
        }

    # -- lifecycle --------------------------------------------------------------------------

    def setup(self, restored_state: dict | None = None) -> None:
        """Build the energon loader, continuing from `restored_state` when given."""
        if self._loader is not None:
            raise RuntimeError("setup() was already called on this loader")
        # energon asks torch's DataLoader for pinned memory, which warns on every CPU loader
        warnings.filterwarnings("ignore", message=".*pin_memory.*", category=UserWarning)
        quiet_progress_bars()
        if not (self._data_path / ".nv-meta").is_dir():
            raise UserInputError(
                f"data.train.path {str(self._data_path)!r}: not a prepared energon data set "
                "(no .nv-meta; run `sft-runtime prepare-data` or `demo-data`)"
            )
        energon_state = None
        if restored_state is not None:
            if (
                not isinstance(restored_state, dict)
                or restored_state.get("format") != STATE_FORMAT
                or restored_state.get("version") != STATE_VERSION
            ):
                raise LoaderStateMismatchError("not a colocated loader state (format/version)")
            check_fingerprint(restored_state["fingerprint"], self.fingerprint())
            # energon's restore mutates the state it is given: keep the caller's intact
            energon_state = copy.deepcopy(restored_state["energon_state"])
            self._committed_steps = int(restored_state["committed_steps"])
            self._committed_samples = int(restored_state["committed_samples"])
        check_enough_samples(
            self._data_path, self.spec.split, self.logical_world_size, self.spec.num_workers
        )
        self._build(energon_state)

    def _build(self, energon_state: Any) -> None:
        from megatron.energon import (
            WorkerConfig,
            get_savable_loader,
            get_train_dataset,
            reraise_exception,
        )

        from sft_runtime.runtime.data.task_encoder import SFTTaskEncoder

        spec = self.spec
        worker_config = WorkerConfig(
            rank=self.logical_rank,
            world_size=self.logical_world_size,
            num_workers=spec.num_workers,
            seed_offset=spec.seed,
            global_error_handler=reraise_exception,
        )
        task_encoder = SFTTaskEncoder(
            self._tokenizer,
            max_input_seq_length=spec.max_input_seq_length,
            pad_multiple=spec.pad_multiple,
            only_unmask_final=spec.only_unmask_final,
            packing_algorithm=spec.packing_algorithm,
            max_sequences_per_bin=spec.max_sequences_per_bin,
            balanced_knapsack_delta=spec.balanced_knapsack_delta,
            overlong=spec.overlong_samples,
            chat_format=spec.chat_format,
            prompt=spec.prompt,
        )
        # data.shuffle false: no slice shuffle, one slice at a time (config.py's docstring)
        order: dict[str, Any] = {}
        if not spec.shuffle:
            order = {"shuffle_over_epochs_multiplier": None, "parallel_shard_iters": 1}
        try:
            dataset = get_train_dataset(
                str(self._data_path),
                split_part=spec.split,
                worker_config=worker_config,
                batch_size=spec.batch_size,
                shuffle_buffer_size=spec.shuffle_buffer_size,
                max_samples_per_sequence=None,
                # Endless stream; our virtual epochs are counted in steps (see config.py).
                virtual_epoch_length=0,
                task_encoder=task_encoder,
                **order,
            )
        except Exception as exc:  # noqa: BLE001 - energon's checks are asserts and ValueErrors
            raise DataSetError(
                f"data.train.path {str(self._data_path)!r}: energon cannot open the data set "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        extra: dict[str, Any] = {}
        if spec.num_workers >= 2:
            # Per-sample snapshots: otherwise a state saved in a restored loader before every
            # worker produced again is stale, and two aborts in a row replay delivered batches.
            extra = {"checkpoint_every_sec": 0, "checkpoint_every_min_n_samples": 1}
        loader = get_savable_loader(
            dataset, gc_collect_every_n_steps=0, watchdog_timeout_seconds=None, **extra
        )
        if energon_state is not None:
            loader.restore_state_rank(energon_state)
        self._loader, self._iter = loader, None
        # what each worker process had delivered when this loader started (`energon_position`)
        self._start_counters = list(getattr(loader, "_worker_sample_counters", ()))

    def _energon_state(self) -> Any:
        """energon's position, workers that delivered nothing taken at their start."""
        return energon_position(self._loader, self._start_counters)

    def _release(self) -> None:
        """Stop the energon loader: its iterator, worker processes and queues."""
        loader, it = self._loader, self._iter
        self._loader = self._iter = None
        release_energon_loader(loader, it)

    def close(self) -> None:
        """Release everything; the loader cannot be used afterwards. Safe to call twice."""
        self._active = None
        self._state_before_active = None
        self._release()

    # -- steps ------------------------------------------------------------------------------

    def _require_loader(self) -> None:
        if self._loader is None:
            raise RuntimeError("the loader is not set up (call setup() first) or was closed")

    def _next_batch(self) -> SFTBatch:
        if self._iter is None:
            self._iter = iter(self._loader)
        try:
            return next(self._iter)
        except StopIteration:
            raise RuntimeError(
                f"{self._data_path} split {self.spec.split!r} yields no batches for "
                f"logical rank {self.logical_rank}"
            ) from None
        except Exception as exc:
            explained = explain_load_error(self._data_path, self.spec.split, exc)
            if explained is None:
                raise
            raise explained from exc

    def load(self) -> StepEnvelope:
        """Fetch the next batch (kept in `active_batch`) and describe it."""
        self._require_loader()
        if self._active is not None:
            raise RuntimeError("a batch is already active: commit() or abort() it first")
        start = time.perf_counter()
        state_before = self._energon_state()
        batch = self._next_batch()
        return self._activate(state_before, batch, time.perf_counter() - start)

    def _activate(self, state_before: Any, batch: SFTBatch, seconds: float) -> StepEnvelope:
        """Make `batch` the active one. A sample its template refused stops the run here,
        with the batch active, so the abort that follows rewinds to just before it."""
        self._state_before_active = state_before
        self._active = batch
        if batch.refused_samples and not self.spec.skip_bad_samples:
            raise refused_sample_error(self._data_path, batch.refused_samples)
        return self._envelope(batch, seconds)

    def _envelope(self, batch: SFTBatch, seconds: float) -> StepEnvelope:
        epoch_length = self.spec.virtual_epoch_length
        extra = {"step_index": self._committed_steps}
        if epoch_length:
            extra["epoch"] = self._committed_steps // epoch_length
        return StepEnvelope(
            logical_rank=self.logical_rank,
            logical_world_size=self.logical_world_size,
            source_ids=list(batch.source_ids),
            field_names=list(FIELD_NAMES),
            sequence_lengths=list(batch.sequence_lengths),
            load_seconds=seconds,
            valid_tokens=batch.valid_tokens,
            physical_packs=batch.num_rows,
            extra=extra,
            overlong_samples=len(batch.overlong_ids),
            skipped_samples=len(batch.refused_samples),
        )

    def fetch_ahead(self) -> tuple[Any, SFTBatch]:
        """Fetch the next batch WITHOUT making it active: (energon state before it, batch).

        For read-ahead wrappers (`PrefetchingLoader`, below). The batch is not consumed: it only
        counts once it is passed to `activate_fetched` and committed. Allowed while a batch
        is active (the read-ahead runs past it); `abort()` then rewinds to the state before
        the active batch, which discards every batch fetched ahead as well. Not thread-safe
        with respect to the other methods that touch energon (`abort`, `state_dict`, `close`):
        the caller serializes them.
        """
        self._require_loader()
        state_before = self._energon_state()
        return state_before, self._next_batch()

    def activate_fetched(
        self, state_before: Any, batch: SFTBatch, load_seconds: float
    ) -> StepEnvelope:
        """Make a batch from `fetch_ahead` the active one, exactly as if `load()` fetched it.

        Batches must be activated in the order they were fetched, each after the previous
        one was committed.
        """
        self._require_loader()
        if self._active is not None:
            raise RuntimeError("a batch is already active: commit() or abort() it first")
        return self._activate(state_before, batch, load_seconds)

    def state_dict_at(self, energon_state: Any) -> dict:
        """`state_dict()` with a given energon position (the state before the oldest batch
        fetched ahead but not yet committed), for read-ahead wrappers."""
        self._require_loader()
        if self._active is not None:
            raise RuntimeError("cannot save the loader state while a batch is active")
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "committed_steps": self._committed_steps,
            "committed_samples": self._committed_samples,
            "energon_state": energon_state,
        }

    @property
    def active_batch(self) -> SFTBatch:
        if self._active is None:
            raise RuntimeError("no active batch: call load() first")
        return self._active

    def commit(self) -> None:
        """Accept the active batch: it counts as consumed and is never delivered again."""
        batch = self.active_batch
        self._committed_steps += 1
        self._committed_samples += len(batch.source_ids)
        self._active = None
        self._state_before_active = None

    def abort(self) -> None:
        """Drop the active batch and rewind, so the next load() delivers the same samples.

        Without an active batch this does nothing (cleanup paths may call it blindly).
        """
        if self._active is None:
            return
        state = self._state_before_active
        self._active = None
        self._state_before_active = None
        self._release()
        self._build(state)

    def state_dict(self) -> dict:
        """The state after the last committed batch, with its fingerprint."""
        self._require_loader()
        return self.state_dict_at(self._energon_state())


# ---------------------------------------------------------------------- energon's position
# energon's loader position, taken so that a resume delivers exactly the next batch.
#
# energon asks each worker process for its checkpoint at the last sample that worker
# delivered. A worker asked before its iterator stored its first checkpoint answers with a
# state one sample ahead (seen about one time in three right after the first batch with two
# workers), so a resume from that state would skip the worker's next batch. A worker that has
# delivered nothing since the loader was built is exactly where the loader started it: at the
# state restored into it, or at the initial one. Both are known in this process without asking
# the worker, so `energon_position` takes them from here.


def energon_position(loader: Any, start_counters: Sequence[int]) -> Any:
    """``loader.save_state_rank()``, with every worker whose delivery counter has not moved
    since ``start_counters`` (read when the loader was built) set to its starting state."""
    state = loader.save_state_rank()
    if state is None or getattr(loader, "num_workers", 0) < 2:
        return state
    counters = list(loader._worker_sample_counters)
    idle = [
        w for w, (now, then) in enumerate(zip(counters, start_counters, strict=True)) if now == then
    ]
    if idle:
        from megatron.energon.savable_loader import SavableDatasetCheckpoint

        initial = loader.dataset.get_initial_checkpoint()
        for w in idle:
            state.worker_states[w] = (
                SavableDatasetCheckpoint(state=None, offset=0) if initial is None else initial[w]
            )
    return state


# ---------------------------------------------------------------------- reading ahead
# `PrefetchingLoader`: read the next batches ahead of the step that needs them, exactly.
#
# Two ways to read ahead, chosen when the loader is built:
#
# - ``background=True`` (``data_plane.max_partitions = depth >= 2``): a thread fetches up to
#   ``depth`` batches ahead, so a loading-heavy step (a chat template rendered in Python) finds
#   its batch ready; the loader's latency overlaps the previous step's training.
# - ``background=False`` (``data_plane.load_during_allreduce``, depth 2): no thread. The worker
#   calls `fetch_now` while its gradient all-reduce is in flight, the one stretch of a step in
#   which its own thread only waits for the other ranks. The next step's `load()` then takes a
#   batch already in hand, and the fetch's CPU never competes with a forward or backward pass.
#   `load()` with nothing queued (the first step, after an abort) fetches in place.
#
# Why it is exact. A fetch never commits anything. It only calls
# `ColocatedLoader.fetch_ahead()`, which returns a batch together with the energon state taken
# just before that batch was fetched, and queues the pair. The inner loader's counters (steps,
# samples, epochs) move only when the controller commits:
#
# - `load()` takes the oldest queued batch and makes it the inner loader's active batch with
#   its own state (`activate_fetched`), so the envelope, `active_batch`, and the epoch/step
#   index are the ones a plain `load()` would give. Queued batches are never visible before.
# - `commit()` is the inner commit: counters advance by exactly that batch.
# - `abort()` stops the thread, drops every queued batch, and lets the inner loader rewind to
#   the state before the active batch (energon is rebuilt from it), which is also the state
#   before every batch fetched after it. The next `load()` delivers the same batches again.
# - `state_dict()` (refused while a batch is active, like the inner one) returns the inner
#   loader's state with the energon position before the OLDEST queued batch, or energon's
#   current position when nothing is queued: the state after the last committed batch, never
#   counting read-ahead. Restoring it into a fresh loader re-delivers the queued batches.
#
# Threads. energon objects are touched by one thread at a time: the background thread while it
# fetches (``_busy``), the caller's thread only for `setup`, `abort`, `close` and a
# `state_dict` with nothing queued, which first pause the fetcher and wait until its current
# fetch ends. `load`, `commit` and a `state_dict` with a batch queued only move Python objects
# under the lock. energon is not thread-safe even across loaders: while a loader iterates it
# keeps its `WorkerConfig` in a process-global class variable
# (``WorkerConfig.active_worker_config``, which the task encoder's packing seed also reads), so
# every energon call made here also holds the process-wide `ENERGON_LOCK`. Code that drives a
# plain `ColocatedLoader` in a process where a `PrefetchingLoader` runs must hold it too.
# With ``num_workers=0`` energon runs the task encoder in the fetching thread; it builds tensors
# but does no math on the model, so training numerics (which run in the caller's thread with its
# torch settings) are unchanged.
#
# Memory: at most ``depth`` batches are held at once: the active one, the queued ones and the
# one being fetched.


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

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
import time
import warnings
from collections.abc import Sequence
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

        For read-ahead wrappers (`runtime.data.prefetch`). The batch is not consumed: it only
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

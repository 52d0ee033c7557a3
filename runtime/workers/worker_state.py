"""`WorkerState`: what a policy worker saves, restores and shows of its state.

The checkpoint files of one rank (weights and optimizer written once across the ranks, an
RNG file per rank; layout in `runtime.checkpoint.policy_files`), the background writer
that holds a checkpoint's values while the next steps train, and CPU copies for
inspection. A worker owns one and forwards its state calls here: the replica and the
worker's place in the group are all it needs, handed over when it is built.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sft_runtime.runtime.checkpoint import policy_files as ckpt
from sft_runtime.runtime.checkpoint import sharded
from sft_runtime.runtime.data.tokenizer import save_tokenizer
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.lora.base import BASE_FILE, base_record, weights_digest
from sft_runtime.runtime.policy.config import PolicyConfig
from sft_runtime.runtime.policy.hf_model import write_hf_config
from sft_runtime.runtime.policy.replica import Replica
from sft_runtime.runtime.policy.replica_files import load_trainer_state, trainer_state
from sft_runtime.runtime.workers.background_writes import (
    BackgroundWrites,
    Copies,
    Staging,
    Write,
)
from sft_runtime.runtime.workers.results import CheckpointFiles, CheckpointLoaded


class WorkerState:
    """Checkpoint and inspection calls of one rank's replica."""

    def __init__(
        self,
        replica: Replica,
        policy: PolicyConfig,
        *,
        rank: int,
        world_size: int,
        num_threads: int,
    ) -> None:
        self.replica = replica
        self.policy = policy
        self.rank = rank
        self.world_size = world_size
        self.num_threads = num_threads
        self.writes = BackgroundWrites()
        self.staging = Staging()  # what `begin_checkpoint` copies into, kept between saves
        self._base_digest: str | None = None  # the LoRA base's, computed once

    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        is_final_checkpoint: bool = False,
        *,
        rng_path: str | None = None,
        _otel_carrier: dict | None = None,
    ) -> CheckpointFiles:
        """Write this rank's share of a checkpoint; returns the files it wrote.

        Replicas are bitwise identical, so one copy of each file is written and the big ones
        are spread over the ranks to write in parallel: rank 0 the weights and the tokenizer
        (`save_tokenizer`), rank ``1 % world_size`` the optimizer; every rank its RNG file (default
        ``<dirname(weights_path)>/rng``). Sharded (FSDP2), every rank writes its own shards of
        weights and optimizer (`runtime.checkpoint.sharded`): a collective.
        """
        writes = self._checkpoint_writes(
            weights_path, optimizer_path, tokenizer_path, is_final_checkpoint, rng_path, Copies()
        )  # fsynced here: the caller may count on them on their own
        files = [path for write in writes for path in write()]
        return CheckpointFiles(self.rank, self.replica.steps_done, tuple(files))

    def begin_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        is_final_checkpoint: bool = False,
        *,
        rng_path: str | None = None,
        _otel_carrier: dict | None = None,
    ) -> CheckpointFiles:
        """`save_checkpoint` with the writing done by a thread while the next steps train
        (see `runtime.workers.background_writes`); `checkpoint_written(weights_path)` returns
        what `save_checkpoint` would. The files are not fsynced one by one: they belong in a
        checkpoint folder whose caller fsyncs it whole before it commits it (`fsync_tree`).
        A sharded save is a collective in step with the peers: it is written here. Never
        raises: an error is `checkpoint_written`'s to report."""
        result = {"rank": self.rank, "step": self.replica.steps_done}
        copies = Copies(self.staging)
        try:
            writes = self._checkpoint_writes(
                weights_path,
                optimizer_path,
                tokenizer_path,
                is_final_checkpoint,
                rng_path,
                copies,
                fsync=False,
            )
            if self.replica.sharded:  # a collective: written now, in step with the peers
                files = [path for write in writes for path in write()]
                writes = [lambda: files]
        except BaseException as exc:  # noqa: BLE001 - reported by checkpoint_written
            self.writes.failed(weights_path, exc)
        else:
            self.writes.submit(weights_path, writes, result, copies.take if copies else None)
        return CheckpointFiles(self.rank, self.replica.steps_done)  # its files: not yet

    def checkpoint_written(
        self, weights_path: str, *, _otel_carrier: dict | None = None
    ) -> CheckpointFiles:
        """The files of the checkpoint `begin_checkpoint` handed over, once written (the
        caller fsyncs the folder). Served by a thread of its own, so it does not queue behind
        the steps."""
        done = self.writes.wait(weights_path)
        return CheckpointFiles(done["rank"], done["step"], tuple(done["files"]))

    def _checkpoint_writes(
        self,
        weights_path: str,
        optimizer_path: str | None,
        tokenizer_path: str | None,
        is_final_checkpoint: bool,
        rng_path: str | None,
        copies: Copies,
        *,
        fsync: bool = True,
    ) -> list[Write]:
        """This rank's share of a checkpoint as writes to run. The weights and optimizer
        state they write are registered in ``copies``: copied by `Copies.take` when the writes
        run beside the next step, or else read by each write when it runs. Without ``fsync``
        the files are left for the caller to fsync with their folder (the tokenizer and the
        model config always are)."""
        if self.replica.step_open:
            raise RuntimeError(f"rank {self.rank}: cannot save while a train step is open")
        writes: list[Write] = []
        if self.replica.sharded:  # every rank writes its shards; rank 0 the rest
            writes.append(lambda: self.replica.files.save_shards(weights_path, optimizer_path))
            if optimizer_path is not None and self.rank == 0:
                path = os.path.join(optimizer_path, sharded.TRAINER_STATE)
                state = {
                    **trainer_state(self.replica.steps_done),
                    "is_final_checkpoint": is_final_checkpoint,
                }
                writes.append(lambda: [ckpt.save_torch(path, state, fsync=fsync)])
        elif optimizer_path is not None and self.rank == 1 % self.world_size:
            opt_path = os.path.join(optimizer_path, ckpt.OPTIMIZER_FILE)
            final = bool(is_final_checkpoint)
            opt = copies.add(
                "optimizer",
                lambda: {
                    **self.replica.files.optimizer_state(self.replica.steps_done),
                    "is_final_checkpoint": final,
                },
            )
            writes.append(lambda: [ckpt.save_torch(opt_path, opt(), fsync=fsync)])
        if self.rank == 0:
            if not self.replica.sharded:  # a CPU copy either way: never two held at once
                weights = copies.add("weights", lambda: self.replica.files.weights(copy=False))
                writes.append(lambda: ckpt.save_weights(weights_path, weights(), fsync=fsync))
            if self.replica.lora_targets is not None:  # adapters: name the base they need
                record = self._lora_record()
                base_file = os.path.join(weights_path, BASE_FILE)

                def write_base() -> list[str]:
                    ckpt.atomic_write(base_file, lambda fh: fh.write(record), fsync=fsync)
                    return [base_file]

                writes.append(write_base)
            elif self.replica.is_hf:
                model = self.replica.model  # only its config is read
                writes.append(lambda: write_hf_config(model, weights_path, dtype=torch.float32))
            if tokenizer_path is not None:
                spec = self.policy.tokenizer
                writes.append(lambda: save_tokenizer(spec, tokenizer_path))
        rng_dir = rng_path or _default_rng_dir(weights_path)
        rng_file = os.path.join(rng_dir, ckpt.rng_file(self.rank))
        rng = ckpt.capture_rng(self.num_threads)
        writes.append(lambda: [ckpt.save_torch(rng_file, rng, fsync=fsync)])
        return writes

    def _lora_record(self) -> bytes:
        """``lora.json`` of this run: the base's digest is taken once, when first saved."""
        base = self.policy.model_name
        assert base is not None  # adapters train a Hugging Face model, which it names
        if self._base_digest is None:
            self._base_digest = weights_digest(base)
        lora = self.policy.dtensor_cfg.lora_cfg
        targets = self.replica.lora_targets
        assert targets is not None  # written only for a LoRA run
        return base_record(base, self._base_digest, targets, lora.model_dump())

    def load_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        *,
        rng_path: str | None = None,
        allow_thread_change: bool = False,
        reseed_rng: bool = False,
        _otel_carrier: dict | None = None,
    ) -> CheckpointLoaded:
        """Restore weights, optionally optimizer + schedule, and this rank's RNG state
        (``allow_thread_change``: the user allowed another thread count than the saved one).
        With ``reseed_rng`` (a resume on another number of workers, whose saved states
        belong to no rank of this run) the RNGs are seeded from the run's seed, the
        checkpoint's step and this rank instead (`ckpt.derived_seed`)."""
        if self.replica.step_open:
            raise RuntimeError(f"rank {self.rank}: cannot load while a train step is open")
        self.writes.wait_copied()  # a checkpoint being written still reads the old values
        rng_dir = rng_path or _default_rng_dir(weights_path)
        rng_file = os.path.join(rng_dir, ckpt.rng_file(self.rank))
        rng_state = None
        if os.path.isdir(rng_dir) and not reseed_rng:
            rng_state = ckpt.load_torch(rng_file, "RNG state")
        if rng_state is not None:
            ckpt.restore_rng(
                rng_state, self.num_threads, rng_file, allow_change=allow_thread_change
            )
        if self.replica.sharded:
            self.replica.files.load_shards(weights_path, optimizer_path)
            if optimizer_path is not None:
                path = os.path.join(optimizer_path, sharded.TRAINER_STATE)
                trainer = ckpt.load_torch(path, "trainer state")
                self.replica.steps_done = load_trainer_state(trainer)
        elif sharded.is_sharded(weights_path):
            raise UserInputError(
                f"{weights_path}: a sharded checkpoint (policy.dtensor_cfg.enabled=true); resume "
                "with that setting, or export it and start from the export"
            )
        else:
            self.replica.files.load_weights(ckpt.load_weights(weights_path))
            if optimizer_path is not None:
                path = os.path.join(optimizer_path, ckpt.OPTIMIZER_FILE)
                state = ckpt.load_torch(path, "optimizer state")
                self.replica.steps_done = self.replica.files.load_optimizer_state(state)
        if reseed_rng:
            ckpt.seed_rng(ckpt.derived_seed(self.replica.seed, self.replica.steps_done, self.rank))
        return CheckpointLoaded(self.rank, self.replica.steps_done, rng_state is not None)

    # ----------------------------------------------------------------- inspection
    def get_weights(
        self, *, include_frozen: bool = False, _otel_carrier: dict | None = None
    ) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights (tests and debugging); with LoRA the adapters, or with
        ``include_frozen`` the frozen base beside them."""
        return self.replica.files.weights(include_frozen=include_frozen)

    def get_optimizer_state(self, *, _otel_carrier: dict | None = None) -> dict[str, Any]:
        """A CPU copy of the optimizer + schedule state (tests and debugging)."""
        state = self.replica.files.optimizer_state(self.replica.steps_done)
        return _to_cpu(state)


def _default_rng_dir(weights_path: str) -> str:
    return os.path.join(os.path.dirname(os.path.normpath(weights_path)), "rng")


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj

"""One data-parallel replica's optimizer step, in plain torch (no Ray).

The step is split in three so the controller can fan out each phase and trace it:

1. `begin` - one all-reduce of the ranks' supervised-token counts gives the global
   normalizer; gradients are cleared. Every rank must call it (it is a collective).
2. `train` - forward/backward over the rank's own batch in micro-batches of
   ``policy.train_micro_batch_size`` rows (with ``policy.dynamic_batching``, of rows sorted
   by length up to a token budget: `dynamic_batches`), accumulating gradients. Purely local.
3. `finish` - one all-reduce (SUM) of a flat buffer holding every gradient and the loss sum,
   gradient clipping, the LR for this step, the AdamW step. A collective.

Until `finish` reaches the optimizer, `abort` drops the gradients and leaves weights,
optimizer state and step count exactly as they were. Replicas start from the same seed and
apply the same summed gradients, so they stay bitwise identical.

With ``policy.dtensor_cfg.enabled`` (`shard`, `runtime.policy.fsdp`) each rank holds a slice of
the model instead: `train` becomes a collective too (parameters gathered, gradients
reduce-scattered, in step with the other ranks), `finish` all-reduces only the loss and the
ready flags, and checkpoints are every rank's shards (`save_shards`, `load_shards`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from sft_runtime.runtime.data.batch import SFTBatch
from sft_runtime.runtime.errors import PeerStepError
from sft_runtime.runtime.lora.adapters import add_adapters, init_adapters
from sft_runtime.runtime.policy import fsdp
from sft_runtime.runtime.policy.config import PolicyConfig
from sft_runtime.runtime.policy.dynamic_batches import token_budget_micro_batches
from sft_runtime.runtime.policy.loss import NLLLossFn, read_metrics
from sft_runtime.runtime.policy.model import build_model, forward_logits
from sft_runtime.runtime.policy.replica_files import ReplicaFiles
from sft_runtime.runtime.policy.schedule import LrSchedule, build_optimizer
from sft_runtime.runtime.policy.step_outcome import StepFinished, StepUndone
from sft_runtime.traces.context import TRACER
from sft_runtime.traces.spans import ALLREDUCE_SPAN, OPTIMIZER_SPAN


@dataclass
class _OpenStep:
    loss_fn: Any
    local_valid_tokens: int
    global_valid_tokens: int
    trained: bool = False
    rng: Any = None  # torch RNG states when the step began (an abort restores them)
    batch: SFTBatch | None = None  # what `begin` counted, and `train` trains on
    micro_batches: list[dict[str, float]] = field(default_factory=list)
    forward_backward_s: float = 0.0
    loss_sum: float = 0.0


class Replica:
    """Model, AdamW and the open step of one DP replica."""

    def __init__(self, policy: PolicyConfig, *, seed: int, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        self.seed = seed
        self.is_hf = policy.is_hf  # a pretrained Hugging Face model, not the built-in one
        lora = policy.dtensor_cfg.lora_cfg.enabled
        # a frozen LoRA base may be stored in the training precision: it gets no optimizer
        base_dtype = torch.bfloat16 if lora and policy.precision == "bfloat16" else torch.float32
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # same initial weights on every rank
            self.model = build_model(
                policy.model,
                policy.model_name,
                sharded=policy.dtensor_cfg.enabled,
                dtype=base_dtype,
            )
            # the layers peft adapts (None: a full fine-tune); see runtime.lora
            self.lora_targets = (
                add_adapters(self.model, policy.dtensor_cfg.lora_cfg, seed=seed) if lora else None
            )
        if not policy.dtensor_cfg.enabled:
            self.model.to(device)
        # sharded, the model waits in host memory (a pretrained one as a skeleton with no
        # parameter storage, `hf_shards`): `fully_shard` keeps only this rank's slice of each
        # parameter, so neither the host nor a device ever holds it whole
        if policy.dtensor_cfg.activation_checkpointing:
            fsdp.enable_activation_checkpointing(self.model)
        self.sharded = False
        self.start_read: dict[str, int] | None = None  # elements of the model read at start
        self._make_optimizer()
        self.steps_done = 0
        self._open: _OpenStep | None = None

    def _make_optimizer(self) -> None:
        opt = self.policy.optimizer
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, opt.name, opt.kwargs)
        self.schedule = LrSchedule(opt.lr, self.policy.scheduler)
        self.files = ReplicaFiles(
            self.policy,
            self.model,
            self.optimizer,
            lora_targets=self.lora_targets,
            sharded=self.sharded,
            start_read=self.start_read,
        )

    @property
    def lora(self) -> bool:
        """A LoRA run: only the adapters train and are saved (`runtime.lora`)."""
        return self.lora_targets is not None

    def shard(self, world_size: int) -> None:
        """FSDP2 over all DP ranks (`runtime.policy.fsdp`); needs the process group, so the
        worker calls it once it has joined. The optimizer is made anew over the shards."""
        if self.steps_done or self._open is not None:
            raise RuntimeError("shard the replica before its first step")
        mesh = fsdp.build_mesh(self.policy.dtensor_cfg, world_size, self.device)
        fsdp.shard_model(self.model, self.policy.dtensor_cfg, mesh)
        if any(p.is_meta for p in self.model.parameters()):  # a skeleton: read our slices
            from sft_runtime.runtime.policy.hf_shards import fill_from_folder

            assert self.policy.model_name is not None
            # offloaded, the shards live in host memory and only the buffers on the device
            params_at = fsdp.param_device(self.policy.dtensor_cfg, self.device)
            self.start_read = fill_from_folder(self.model, self.policy.model_name, params_at)
            if params_at != self.device:
                fsdp.buffers_to(self.model, self.device)
            if self.lora:
                init_adapters(self.model, self.policy.dtensor_cfg.lora_cfg, seed=self.seed)
        self.sharded = True
        self._make_optimizer()

    # ----------------------------------------------------------------- step phases
    @property
    def step_open(self) -> bool:
        return self._open is not None

    def begin(self, loss_fn: Any, get_batch: Callable[[], SFTBatch]) -> dict[str, int]:
        """Open a step: learn the global number of supervised tokens (collective).

        A rank that fails its local checks still joins the all-reduce with an error flag,
        so its peers fail at once instead of waiting for the process-group timeout.
        """
        loss_fn = loss_fn if loss_fn is not None else NLLLossFn()
        error: Exception | None = None
        local = 0
        try:
            if self._open is not None:
                raise RuntimeError("begin_train_step called while a step is open; abort it first")
            batch = get_batch()
            self._check_shape(batch)
            local = int(loss_fn.valid_tokens(batch))
        except Exception as exc:  # reported after the collective
            error = exc
        count = torch.tensor([float(local), float(error is not None)], dtype=torch.float64)
        count = self._all_reduce(count.to(self.device))
        if error is not None:
            raise error
        if count[1].item() > 0:
            raise PeerStepError("begin_train_step failed on another data-parallel rank")
        self.model.zero_grad(set_to_none=True)
        self._open = _OpenStep(
            loss_fn, local, int(count[0].item()), rng=self._rng_state(), batch=batch
        )
        return {"local_valid_tokens": local, "global_valid_tokens": self._open.global_valid_tokens}

    def train(
        self, batch: SFTBatch | None = None, error: Exception | None = None
    ) -> dict[str, Any]:
        """Forward/backward over the batch (default: the one `begin` counted) in micro-batches
        (`_micro_batches`), accumulating gradients.

        Sharded, every forward and backward is a collective (parameters are gathered,
        gradients reduce-scattered), so the ranks keep in step: they agree first that all of
        them can start (``error``, a failure the caller met before, is raised after that),
        and a loss function that fails on one rank lets that rank run the rest of its
        passes with a zero loss before every rank raises, so the step can be aborted and
        the group trains on.
        """
        open_step = self._open
        mine = batch if batch is not None else open_step.batch if open_step else None
        ordered, spans = (None, []) if mine is None else self._micro_batches(mine)
        passes = len(spans)
        if self.sharded:
            failed = error is not None or open_step is None or open_step.trained
            # packed rows and token budgets vary per rank: every rank runs the most
            # micro-batches any runs
            passes = self.agree(failed, "train_step", passes=0 if failed else passes)
        if error is not None:
            raise error
        step = self._require_open("train_step")
        if step.trained:
            raise RuntimeError("train_step called twice in one step")
        self.model.train()
        t_all = time.perf_counter()
        batch = ordered.to(self.device)  # once, not per micro-batch (no copy on the CPU)
        loss_error: Exception | None = None
        for k in range(passes):
            if k >= len(spans):  # a pass that only keeps the peers' collectives
                mb = self.forward_rows(batch.rows(0, 1))
                mb = replace(mb, loss_mask=torch.zeros_like(mb.loss_mask))
            else:
                mb = self.forward_rows(batch.rows(*spans[k]))
            t0 = time.perf_counter()
            with self.autocast():
                logits = forward_logits(self.model, mb)
            try:
                loss, metrics = step.loss_fn(logits, mb, step.global_valid_tokens)
            except Exception as exc:
                if not self.sharded:
                    raise
                loss_error = loss_error or exc
                loss, metrics = logits.sum() * 0.0, None  # the peers' collectives still match
            loss.backward()
            if metrics is not None and k < len(spans):
                metrics["rows"] = float(spans[k][1] - spans[k][0])
                metrics["forward_backward_s"] = time.perf_counter() - t0
                step.micro_batches.append(metrics)
        if self.sharded:
            self.agree(loss_error is not None, "train_step")
        if loss_error is not None:
            raise loss_error
        step.micro_batches = read_metrics(step.micro_batches)  # the step's one host sync
        for metrics in step.micro_batches:
            step.loss_sum += metrics["nll_sum"]
        step.forward_backward_s = time.perf_counter() - t_all
        step.trained = True
        return {
            "micro_batches": list(step.micro_batches),
            "forward_backward_s": step.forward_backward_s,
        }

    def finish(self, while_reducing: Callable[[], None] | None = None) -> StepFinished:
        """All-reduce gradients and loss, clip, take the optimizer step (collective).

        The flat buffer carries a "not ready" flag: if any rank has no trained step, every
        rank raises before touching its weights (the step stays open for `abort`).
        ``while_reducing`` runs while the all-reduce of a trained step is in flight (the
        worker reads its next batch there); it must not raise and must not touch the model.
        """
        step = self._open
        ready = step is not None and step.trained
        t0 = time.perf_counter()
        peers = dist.is_initialized() and dist.get_world_size() > 1
        if self.sharded:  # gradients were reduce-scattered by the backward passes
            grads = []
        elif not peers:  # nothing to add up: the gradients stay where the backward put them
            grads = []
            for p in self.params if ready else ():
                if p.grad is None:  # as the reduced buffer would hold it: zeros, not None
                    p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        else:
            grads = [
                p.grad
                if ready and p.grad is not None
                else torch.zeros_like(p, memory_format=torch.contiguous_format)
                for p in self.params
            ]
        tail = torch.tensor(
            [step.loss_sum if ready else 0.0, 0.0 if ready else 1.0],
            dtype=torch.float32,
            device=self.device,
        )
        with TRACER.start_as_current_span(ALLREDUCE_SPAN):
            flat = torch.cat([g.reshape(-1) for g in grads] + [tail])
            work = dist.all_reduce(flat, async_op=True) if dist.is_initialized() else None
            if while_reducing is not None and ready:
                while_reducing()
            if work is not None:
                work.wait()
        if not ready:
            phase = "begin_train_step" if step is None else "train_step"
            raise RuntimeError(f"finish_train_step called before a successful {phase}")
        global_nll, peer_not_ready = flat[-2:].tolist()
        if peer_not_ready > 0:
            raise PeerStepError("finish_train_step: another data-parallel rank has no trained step")
        offset = 0
        for p, g in zip(self.params if grads else (), grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p)  # views into the reduced buffer
            offset += n
        t1 = time.perf_counter()
        loss = global_nll / max(step.global_valid_tokens, 1)
        with TRACER.start_as_current_span(OPTIMIZER_SPAN):
            grad_norm = self._clip()
            lr = self.schedule.at(self.steps_done)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # The loss and the norm are the same numbers on every rank (both come from the
            # reduced buffer), so every rank skips a non-finite update together: a diverged
            # step never reaches the weights or the optimizer's moments.
            if math.isfinite(loss) and math.isfinite(grad_norm):
                self.optimizer.step()
            self.model.zero_grad(set_to_none=True)
        self.steps_done += 1
        self._open = None
        t2 = time.perf_counter()
        return StepFinished(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            valid_tokens=step.global_valid_tokens,
            local_valid_tokens=step.local_valid_tokens,
            micro_batches=step.micro_batches,
            forward_backward_s=step.forward_backward_s,
            allreduce_s=t1 - t0,
            optimizer_s=t2 - t1,
            step=self.steps_done,
        )

    def abort(self) -> StepUndone:
        """Drop the open step's gradients and rewind the RNG its forward passes used (dropout):
        weights, optimizer state and random streams are as if the step never began."""
        was_open = self._open is not None
        if was_open:
            self._set_rng_state(self._open.rng)
        self.model.zero_grad(set_to_none=True)
        self._open = None
        return StepUndone(aborted=was_open, step=self.steps_done)

    def forward_rows(self, rows: SFTBatch) -> SFTBatch:
        """A micro-batch's rows as its forward pass takes them. An HF model attends per
        sample (`packed_attention`), so its packed rows run end to end with no padding;
        otherwise no forward runs over columns that are padding in every row (the built-in
        model masks T x T, which joining the rows would enlarge)."""
        multiple = self.policy.make_sequence_length_divisible_by
        dynamic = self.policy.dynamic_batching
        round_to = dynamic.sequence_length_round if dynamic.enabled else 1
        if self.is_hf and rows.packed:
            return rows.joined(multiple, round_to)
        return rows.trimmed(multiple, round_to)

    # ----------------------------------------------------------------- helpers
    def _micro_batches(self, batch: SFTBatch) -> tuple[SFTBatch, list[tuple[int, int]]]:
        """The batch with its rows in the order the micro-batches take them, and each
        micro-batch's rows [start, stop) of it: ``train_micro_batch_size`` rows at a time,
        or with ``dynamic_batching`` the token-budget plan (`dynamic_batches`) over the
        rows' lengths, read off ``cu_seqlens`` (no device sync)."""
        dynamic = self.policy.dynamic_batching
        if not dynamic.enabled:
            size, rows = self.policy.train_micro_batch_size, batch.num_rows
            return batch, [(s, min(s + size, rows)) for s in range(0, rows, size)]
        lengths = [bounds[-1] for bounds in batch.cu_seqlens]
        # a PolicyConfig outside a run config may leave the budget null: the rows as padded
        budget = dynamic.train_mb_tokens or (
            int(batch.input_ids.shape[1]) * self.policy.train_micro_batch_size
        )
        plan = token_budget_micro_batches(lengths, budget, dynamic.sequence_length_round)
        ends = list(accumulate(len(rows) for rows in plan))
        spans = list(zip([0, *ends[:-1]], ends, strict=True))
        return batch.take([i for rows in plan for i in rows]), spans

    def _require_open(self, phase: str) -> _OpenStep:
        if self._open is None:
            raise RuntimeError(f"{phase} called without begin_train_step")
        return self._open

    def _check_shape(self, batch: SFTBatch) -> None:
        multiple = self.policy.make_sequence_length_divisible_by
        if batch.input_ids.shape[-1] % multiple:
            raise ValueError(
                f"batch sequence length {batch.input_ids.shape[-1]} is not a multiple of "
                f"policy.make_sequence_length_divisible_by={multiple}"
            )

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def agree(self, failed: bool, phase: str, passes: int = 0) -> int:
        """Every rank learns whether any failed, and the most ``passes`` any rank has (one
        collective); a healthy rank whose peer failed raises `PeerStepError`, a failed one
        goes on to raise its own error."""
        # the minimum of the negated values: -1 if any failed, minus the largest count
        flags = torch.tensor([-float(failed), -float(passes)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if not failed and flags[0].item() < 0:
            raise PeerStepError(f"{phase} failed on another data-parallel rank")
        return int(-flags[1].item())

    @staticmethod
    def _all_reduce(t: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def _clip(self) -> float:
        max_norm = self.policy.max_grad_norm
        if self.sharded:
            return fsdp.grad_norm(self.params, max_norm)
        if max_norm is None:
            norms = torch.stack([p.grad.detach().norm(2) for p in self.params])
            return float(norms.norm(2).item())
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm).item())

    def autocast(self):
        if self.policy.precision == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

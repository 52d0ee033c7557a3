"""`ReplicaFiles`: what a replica's files hold, read and written.

A concern of its own beside the step phases: the weights a checkpoint or an export takes
(whole, the adapters only with LoRA, gathered when sharded), the optimizer and the
schedule's position, and the per-rank shards of a sharded checkpoint. A `Replica` owns one,
made anew when it shards its model (the optimizer is then made anew over the shards); the
step count stays the replica's, passed in and handed back.
"""

from __future__ import annotations

from typing import Any

import torch

from sft_runtime.runtime.lora.adapters import adapter_parameters, check_adapters
from sft_runtime.runtime.policy import fsdp
from sft_runtime.runtime.policy.config import PolicyConfig
from sft_runtime.runtime.policy.hf_model import hf_state_dict, load_hf_state_dict, own_names

TRAINER_STATE_FORMAT = 1


class ReplicaFiles:
    """The files of one replica's model and optimizer (see module docstring)."""

    def __init__(
        self,
        policy: PolicyConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lora_targets: Any,
        sharded: bool,
        start_read: dict[str, int] | None,
    ) -> None:
        self.policy = policy
        self.model = model
        self.optimizer = optimizer
        self.lora_targets = lora_targets  # the layers LoRA adapts, None in a full fine-tune
        self.sharded = sharded
        self.start_read = start_read  # elements of the model read at a sharded start

    # ----------------------------------------------------------------- state
    def weights(
        self, *, include_frozen: bool = False, copy: bool = True
    ) -> dict[str, torch.Tensor]:
        """A copy of parameters and buffers as contiguous CPU tensors (safetensors-ready),
        under the model's own names; a tied weight once. With LoRA, the adapters only (what
        trains and what a checkpoint holds), unless ``include_frozen``. Without ``copy``,
        the live tensors where the replica holds them whole (not sharded)."""
        adapters_only = self.lora and not include_frozen
        if self.sharded:  # a collective: every rank calls it
            state = fsdp.full_state_dict(self.model, trainable_only=adapters_only)
            state = {k: state[k] for k in own_names(self.model) if k in state}
        elif adapters_only:
            state = dict(adapter_parameters(self.model))
        else:
            state = hf_state_dict(self.model) if self.is_hf else self.model.state_dict()
        if not copy:
            return {k: v.detach() for k, v in state.items()}
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.lora:
            check_adapters(self.model, tensors)
        if self.sharded:
            fsdp.load_full_state_dict(self.model, tensors)
        elif self.lora:
            self.model.load_state_dict(tensors, strict=False)
        elif self.is_hf:
            load_hf_state_dict(self.model, tensors)
        else:
            self.model.load_state_dict(tensors, strict=True)

    @property
    def is_hf(self) -> bool:
        return self.policy.is_hf

    def optimizer_state(self, steps_done: int) -> dict[str, Any]:
        """The optimizer's state plus the schedule's step count; loadable with
        ``weights_only=True``. Sharded, the whole state is gathered (a collective)."""
        if self.sharded:
            optimizer = fsdp.full_optimizer_state(self.model, self.optimizer)
        else:
            optimizer = self.optimizer.state_dict()
        return {**trainer_state(steps_done), "optimizer": optimizer}

    def load_optimizer_state(self, state: dict[str, Any]) -> int:
        """Load the optimizer; returns the step count the state was saved at."""
        steps_done = load_trainer_state(state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.use_config_hyperparameters()
        return steps_done

    def use_config_hyperparameters(self) -> None:
        """The config's optimizer kwargs over those a loaded state carries: a resume the
        user allowed to change them (runtime/resume/config_change.py) trains with the new
        values, as it does with a new lr (set every step); unchanged ones are the same."""
        given = {k: v for k, v in self.policy.optimizer.kwargs.items() if k != "lr"}
        for group in self.optimizer.param_groups:
            for key, value in given.items():
                if key in group:  # as the constructor stored it (betas as a tuple)
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value

    # ----------------------------------------------------------------- sharded files
    def save_shards(self, weights_path: str, optimizer_path: str | None) -> list[str]:
        """This rank's shards of weights and optimizer (a collective; see
        `runtime.checkpoint.sharded`)."""
        optimizer = self.optimizer if optimizer_path else None
        return fsdp.save_shards(self.model, optimizer, weights_path, optimizer_path, self.lora)

    def load_shards(self, weights_path: str, optimizer_path: str | None) -> None:
        optimizer = self.optimizer if optimizer_path else None
        fsdp.load_shards(self.model, optimizer, weights_path, optimizer_path, self.lora)
        if optimizer is not None:
            self.use_config_hyperparameters()

    @property
    def lora(self) -> bool:
        """A LoRA run: only the adapters train and are saved (`runtime.lora`)."""
        return self.lora_targets is not None

    def local_storage(self) -> dict[str, int]:
        """Elements of parameters, gradients and optimizer state this rank holds, and of the
        model it read from the folder at a sharded start (``start_read_*``)."""
        storage = fsdp.local_storage(self.model, self.optimizer)
        if self.start_read is not None:
            storage["start_read_local"] = self.start_read["elements_read"]
            storage["start_read_full"] = self.start_read["elements_whole"]
        return storage


def trainer_state(steps_done: int) -> dict[str, Any]:
    """What the optimizer file holds besides the optimizer: the schedule's position."""
    return {"format": TRAINER_STATE_FORMAT, "scheduler": {"steps_done": steps_done}}


def load_trainer_state(state: dict[str, Any]) -> int:
    """The step count a `trainer_state` holds."""
    if state.get("format") != TRAINER_STATE_FORMAT:
        raise ValueError(f"unknown optimizer checkpoint format {state.get('format')!r}")
    return int(state["scheduler"]["steps_done"])

"""How many parameters a run trains, known before any worker starts.

A LoRA run trains about one percent of its model, a full fine-tune all of it, and the two
differ by that much in memory, speed and what a checkpoint holds: the first thing a user
wants to see is which one the config asked for. The model is built on the meta device (no
weights read, no memory), with the adapters the config names, exactly as a worker builds
it, so the count is the workers' own. Its weights are left uninitialized: a count needs
shapes, and on the meta device torch runs some initializers (``normal_``) through its
compiler's decompositions, whose import costs the driver about 1 s at every launch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sft_runtime.runtime.policy.config import PolicyConfig


@dataclass(frozen=True)
class ParameterCount:
    """Trainable and total parameters of a policy (tied weights counted once)."""

    trainable: int
    total: int
    lora: bool

    def describe(self) -> str:
        """One line for the start of a run."""
        if self.lora:
            share = 100.0 * self.trainable / max(self.total, 1)
            return (
                f"trainable parameters: {self.trainable:,} LoRA adapter weights "
                f"({share:.2f}% of {self.total:,}; the base is frozen)"
            )
        return f"trainable parameters: {self.trainable:,} (a full fine-tune: every parameter)"


def count_parameters(policy: PolicyConfig) -> ParameterCount:
    """The parameters `policy` trains, from a model built on the meta device."""
    import torch

    from sft_runtime.runtime.policy.model import TinyTransformer

    model_cfg = policy.model
    with torch.device("meta"), _weights_left_uninitialized():
        if policy.model_name is not None:
            from transformers import AutoModelForCausalLM

            from sft_runtime.runtime.policy.model_path import hf_config

            model = AutoModelForCausalLM.from_config(hf_config(policy.model_name))
        else:
            model = TinyTransformer(model_cfg)
    if policy.dtensor_cfg.lora_cfg.enabled:
        from sft_runtime.runtime.lora.adapters import add_adapters

        with _weights_left_uninitialized():
            add_adapters(model, policy.dtensor_cfg.lora_cfg, seed=0)
    params = list(model.parameters())
    return ParameterCount(
        trainable=sum(p.numel() for p in params if p.requires_grad),
        total=sum(p.numel() for p in params),
        lora=policy.dtensor_cfg.lora_cfg.enabled,
    )


@contextmanager
def _weights_left_uninitialized() -> Iterator[None]:
    """`torch.nn.init`'s in-place initializers (``normal_``, ``kaiming_uniform_``, ...) do
    nothing inside the block; modules and transformers' models call them through that
    module, so the shapes come out the same."""
    from torch.nn import init

    names = [n for n in vars(init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(init, n) for n in names}

    def leave(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return tensor

    for name in names:
        setattr(init, name, leave)
    try:
        yield
    finally:
        for name, initializer in saved.items():
            setattr(init, name, initializer)

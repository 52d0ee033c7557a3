"""How many parameters a run trains, known before any worker starts.

A LoRA run trains about one percent of its model, a full fine-tune all of it, and the two
differ by that much in memory, speed and what a checkpoint holds: the first thing a user
wants to see is which one the config asked for. The model is built on the meta device (no
weights read, no memory), with the adapters the config names, exactly as a worker builds
it, so the count is the workers' own.
"""

from __future__ import annotations

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
    with torch.device("meta"):
        if policy.model_name is not None:
            from transformers import AutoModelForCausalLM

            from sft_runtime.runtime.policy.model_path import hf_config

            model = AutoModelForCausalLM.from_config(hf_config(policy.model_name))
        else:
            model = TinyTransformer(model_cfg)
    if policy.dtensor_cfg.lora_cfg.enabled:
        from sft_runtime.runtime.lora.adapters import add_adapters

        add_adapters(model, policy.dtensor_cfg.lora_cfg, seed=0)
    params = list(model.parameters())
    return ParameterCount(
        trainable=sum(p.numel() for p in params if p.requires_grad),
        total=sum(p.numel() for p in params),
        lora=policy.dtensor_cfg.lora_cfg.enabled,
    )

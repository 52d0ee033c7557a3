"""peft's LoRA layers put into a Hugging Face model in place, the base frozen.

The adapters go into the `transformers` model itself (`peft.inject_adapter_in_model`), not
into a `PeftModel` around it: the forward pass, the packed attention, FSDP's decoder layers
and activation checkpointing all see the model they see without LoRA. A targeted layer
``q_proj`` becomes peft's LoRA layer, whose frozen weight is ``q_proj.base_layer.weight``
and whose adapters are ``q_proj.lora_A.default.weight`` and ``q_proj.lora_B.default.weight``
(`peft_key` turns these into the names of peft's ``adapter_model.safetensors``).

Adapters are float32 whatever the base is stored in, so AdamW updates a float32 master copy
while a bfloat16 base halves the frozen weights' memory. Their first values are drawn here
(`init_adapters`) rather than by peft as each layer is built: from a generator seeded with
the run's seed, in parameter-name order, whole on the host and then cut to this rank's
shard, so that a sharded start (adapters built on the meta device) and a whole one begin
from the same adapters, bit for bit.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable

import torch
from torch import nn

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.lora.config import PEFT_INSTALL, LoraConfig

ADAPTER = "default"  # peft's name for a model's one adapter
_MARKERS = (f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}.")


def require_peft() -> None:
    """peft is an optional extra: its absence is bad input, with the line that fixes it."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserInputError(
            "policy.dtensor_cfg.lora_cfg.enabled=true needs the peft package, which is not "
            "installed: "
            f"{PEFT_INSTALL}"
        ) from None


def is_adapter(name: str) -> bool:
    """A parameter name of a LoRA adapter (what trains and what a LoRA checkpoint holds)."""
    return any(marker in name for marker in _MARKERS)


def base_name(name: str) -> str:
    """The name a frozen parameter has in the base model's own files."""
    return name.replace(".base_layer.", ".")


def peft_key(name: str) -> str:
    """An adapter's name in peft's ``adapter_model.safetensors`` (the adapter's name dropped,
    under the `PeftModel`'s prefix)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _tied_head(model: nn.Module) -> str | None:
    """The LM head's module name when its weight is the input embedding's."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return None
    return next(n for n, m in model.named_modules() if m is head)


def _matches(pattern: str, name: str) -> bool:
    return name == pattern or name.rsplit(".", 1)[-1] == pattern or fnmatch.fnmatch(name, pattern)


def target_modules(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Full names of the linear layers ``cfg`` adapts, in the model's order; a name in the
    config that matches no linear layer is refused (a typo would otherwise train nothing)."""
    linear = list(_linear_layers(model))
    tied = _tied_head(model)
    for key, patterns in (
        ("target_modules", cfg.target_modules),
        ("exclude_modules", cfg.exclude_modules),
    ):
        for i, pattern in enumerate(patterns):
            if not any(_matches(pattern, name) for name in linear):
                shown = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linear}))
                raise UserInputError(
                    f"policy.dtensor_cfg.lora_cfg.{key}[{i}]={pattern!r} matches no linear layer "
                    "of "
                    f"{type(model).__name__} (its linear layers: {shown})"
                )
    if cfg.target_modules:
        chosen = [n for n in linear if any(_matches(p, n) for p in cfg.target_modules)]
        if tied in chosen:
            raise UserInputError(
                f"policy.dtensor_cfg.lora_cfg.target_modules: {tied!r} is tied to the input "
                "embedding, and "
                "a merged adapter would change the embedding too; leave it out"
            )
        return chosen
    return [n for n in linear if n != tied and not any(_matches(p, n) for p in cfg.exclude_modules)]


def peft_config(cfg: LoraConfig, targets: list[str], base: str | None = None):
    """peft's own config for the adapters (what ``adapter_config.json`` holds)."""
    require_peft()
    import peft

    return peft.LoraConfig(
        r=cfg.dim,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(targets),
        bias="none",
        init_lora_weights=True,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def add_adapters(model: nn.Module, cfg: LoraConfig, *, seed: int) -> list[str]:
    """Put the adapters into ``model`` (on the meta device where its parameters are), freeze
    everything else, and, on real storage, draw their first values. Returns the targets."""
    require_peft()
    import peft

    targets = target_modules(model, cfg)
    on_meta = any(p.is_meta for p in model.parameters())
    peft.inject_adapter_in_model(
        peft_config(cfg, targets), model, adapter_name=ADAPTER, low_cpu_mem_usage=on_meta
    )
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
        if is_adapter(name) and param.dtype != torch.float32:
            param.data = param.data.float()
    if not on_meta:
        init_adapters(model, cfg, seed=seed)
    return targets


def adapter_parameters(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if is_adapter(n))


def check_adapters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Saved adapters are exactly the model's (another ``policy.dtensor_cfg.lora_cfg`` adapts "
    "other layers)."""
    expected = {name for name, _ in adapter_parameters(model)}
    if set(tensors) != expected:
        raise UserInputError(
            "checkpoint adapters do not match the model's: missing "
            f"{sorted(expected - set(tensors))[:5]}, unexpected "
            f"{sorted(set(tensors) - expected)[:5]} (was policy.dtensor_cfg.lora_cfg changed?)"
        )


@torch.no_grad()
def init_adapters(model: nn.Module, cfg: LoraConfig, *, seed: int) -> None:
    """A from ``lora_A_init``, B zero (see the module docstring), whole or sharded."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in adapter_parameters(model):
        full = torch.zeros(param.shape, dtype=torch.float32)
        if f".lora_A.{ADAPTER}." in name:
            if cfg.lora_A_init == "xavier":
                nn.init.xavier_normal_(full, generator=generator)
            else:
                nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        _copy_into(param, full)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """``full`` into ``param``, or into this rank's shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def check_lora(hf_config: object, cfg: LoraConfig) -> list[str]:
    """Before any worker starts: peft is there and the targets match the model's layers
    (checked on a model built on the meta device, no weight read). Returns the targets."""
    require_peft()
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return target_modules(model, cfg)

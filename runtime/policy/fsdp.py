"""FSDP2 for a replica: shard the model over the data-parallel workers, and what changes then.

`shard_model` applies `fully_shard` to every decoder layer and then to the root, over a
device mesh of all DP ranks (1-D, or replicate x shard with
``policy.dtensor_cfg.dp_replicate_size``), as torchtitan composes it. Each rank then keeps
only its slice of every parameter, of its gradient and (because AdamW's moments are created
like the parameters) of the optimizer state: a model larger than one device fits.

What the rest of the replica relies on keeps its meaning:

- Gradients are summed over the ranks, not averaged (``gradient_divide_factor = 1``): the
  loss is already divided by the global number of supervised tokens, exactly as in the
  unsharded path, whose flat all-reduce sums too.
- `grad_norm` is the norm of the whole gradient: each rank's shard contributes its squares,
  DTensor adds them over the mesh. Clipping then scales every shard by the same factor.
- `full_state_dict` gathers the whole model under its own parameter names (what the
  inspection calls and the exact-resume tests compare); it is a collective.

With ``policy.dtensor_cfg.cpu_offload`` every unit takes FSDP2's `CPUOffloadPolicy`: the
shards of parameters, gradients and optimizer state live in host memory (`param_device`),
each unit's parameters are gathered on the device for its forward and backward, and the
optimizer step and `grad_norm` run on the CPU. Buffers stay on the device, where the forward
runs. With CUDA the process group then needs gloo beside NCCL for the collectives over CPU
tensors (`rendezvous.backend`); on a CPU device nothing moves and the numbers are the same.

Activation checkpointing recomputes each decoder layer in the backward pass (our transformer
through ``checkpoint_blocks``, a Hugging Face model through its own switch), so parameter
names never change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sft_runtime.runtime.policy.config import DTensorConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of the model, each its own FSDP unit."""
    blocks = getattr(model, "blocks", None)  # our transformer
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    inner = getattr(model, "model", None)  # Llama, Qwen2, Mistral, Gemma: model.model.layers
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    raise ValueError(
        f"policy.dtensor_cfg.enabled: cannot find the decoder layers of {type(model).__name__} "
        "(expected model.blocks or model.model.layers)"
    )


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass. A Hugging Face model
    offers it as ``activation_checkpointing_enable`` in the transformers this project pins,
    and only as ``gradient_checkpointing_enable`` in older ones (5.17, say), which machine
    images with transformers preinstalled may carry."""
    hf_enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None
    )
    if hasattr(model, "checkpoint_blocks"):
        model.checkpoint_blocks = True
    elif hf_enable is not None:
        hf_enable({"use_reentrant": False})
    else:
        raise ValueError(
            f"policy.dtensor_cfg.activation_checkpointing: {type(model).__name__} offers none"
        )


def build_mesh(parallel: DTensorConfig, world_size: int, device: torch.device) -> Any:
    """The DP ranks as one shard dimension, or replicate x shard (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel.dp_replicate_size > 1:
        shape = (parallel.dp_replicate_size, world_size // parallel.dp_replicate_size)
        return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))


def param_device(parallel: DTensorConfig, device: torch.device) -> torch.device:
    """Where this rank's parameter shards live: host memory with ``cpu_offload``."""
    return torch.device("cpu") if parallel.cpu_offload else device


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Every buffer (rotary frequencies and the like) onto ``device``, where the forward
    runs; a buffer shared by two modules stays one tensor. FSDP2 offloads parameters only,
    so a skeleton filled in host memory (``cpu_offload``) puts its buffers back here."""
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                if id(buffer) not in moved:
                    moved[id(buffer)] = (buffer, buffer.to(device))
                module._buffers[name] = moved[id(buffer)][1]


def shard_model(model: nn.Module, parallel: DTensorConfig, mesh: Any) -> None:
    """`fully_shard` each decoder layer, then the root (which takes the embeddings, the
    final norm and the LM head, tied or not); gradients are summed over the ranks. With
    ``cpu_offload`` the shards are kept in host memory, pinned where the device is a GPU
    (copies to and from it can then overlap the compute)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES.get(parallel.param_dtype or ""),
        reduce_dtype=DTYPES.get(parallel.reduce_dtype or ""),
    )
    offload = (
        CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
        if parallel.cpu_offload
        else OffloadPolicy()  # fully_shard's default: nothing offloaded
    )
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by the backward pass
        reshard = parallel.reshard_after_forward and i < len(layers) - 1
        fully_shard(
            layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload
        )
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=parallel.reshard_after_forward,
        mp_policy=mp,
        offload_policy=offload,
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def grad_norm(params: list[nn.Parameter], max_norm: float | None) -> float:
    """The global gradient norm (shards reduced over the mesh); clips when ``max_norm``.
    Computed where the gradient shards are: in host memory with ``cpu_offload`` (the
    reduction then goes through the process group's CPU backend)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total.item())


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def full_state_dict(model: nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (or, ``trainable_only``, the parameters that train: a LoRA
    run's adapters, the frozen base not gathered), whole, under the model's own names (a
    collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    options = _options(full_state_dict=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    if trainable_only:
        trains = {n for n, p in model.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trains}
    return state


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state, whole, keyed by parameter name (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True))


def load_full_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Whole tensors (from a safetensors file) into the shards (every rank passes them)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, tensors, options=_options(full_state_dict=True, strict=False))


def sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, *, trainable_only: bool = False
) -> dict[str, Any]:
    """This rank's shards: ``{"model": ...}`` and, with an optimizer, ``"optimizer"``. A
    parameter shared under two names (an LM head tied to the embedding) is kept under its
    first name only, as the whole-weights checkpoint keeps it: written once, not twice.
    ``trainable_only``: the parameters that train (a LoRA run's adapters), not a frozen base."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    shared = set(dict(model.named_parameters(remove_duplicate=False))) - set(
        dict(model.named_parameters())
    )
    model_state = {k: v for k, v in get_model_state_dict(model).items() if k not in shared}
    if trainable_only:
        trains = {n for n, p in model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trains}
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def load_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Put shards read into `sharded_state`'s dict back into the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # not strict: a tied duplicate is absent by design (the shared parameter is filled under
    # its first name); every other key was read, or the checkpoint load already failed
    set_model_state_dict(model, state["model"], options=_options(strict=False))
    if optimizer is not None and "optimizer" in state:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def save_shards(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights_path: str,
    optimizer_path: str | None,
    trainable_only: bool,
) -> list[str]:
    """This rank's shards of the weights (those that train, ``trainable_only``) and of the
    optimizer, as torch.distributed.checkpoint files (a collective)."""
    from sft_runtime.runtime.checkpoint import sharded

    state = sharded_state(model, optimizer, trainable_only=trainable_only)
    files = sharded.save_shards(weights_path, {"model": state["model"]})
    if optimizer_path is not None:
        files += sharded.save_shards(optimizer_path, {"optimizer": state["optimizer"]})
    return files


def load_shards(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights_path: str,
    optimizer_path: str | None,
    trainable_only: bool,
) -> None:
    """`save_shards`' files read back into this rank's shards (a collective)."""
    from sft_runtime.runtime.checkpoint import sharded

    state = sharded_state(model, optimizer, trainable_only=trainable_only)
    sharded.load_shards(weights_path, {"model": state["model"]})
    if optimizer_path is not None:
        sharded.load_shards(optimizer_path, {"optimizer": state["optimizer"]})
    load_sharded_state(model, optimizer, state)


def offloaded_elements(model: nn.Module) -> int:
    """Elements of this rank's parameter shards that FSDP2 keeps in host memory under a
    `CPUOffloadPolicy`, as FSDP2's own records of each unit say (0 when nothing is)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        for group in groups:
            if group is None or not isinstance(group.offload_policy, CPUOffloadPolicy):
                continue
            for fsdp_param in group.fsdp_params:
                local = fsdp_param.sharded_param.to_local()
                total += local.numel() if local.device.type == "cpu" else 0
    return total


def local_storage(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Elements this rank stores (``*_local``) and the whole model's (``*_full``), for
    parameters, gradients and optimizer state, read from the DTensor shards; and of its
    parameter shards kept in host memory by ``cpu_offload`` (``params_offloaded_local``)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        return (t.to_local() if isinstance(t, DTensor) else t).numel()

    params = [p for p in model.parameters()]
    moments = [
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim
    ]
    grads = [p.grad for p in params if p.grad is not None]
    return {
        "params_local": sum(local(p) for p in params),
        "params_full": sum(p.numel() for p in params),
        "grads_local": sum(local(g) for g in grads),
        "grads_full": sum(g.numel() for g in grads),
        "optimizer_local": sum(local(v) for v in moments),
        "optimizer_full": sum(v.numel() for v in moments),
        "params_offloaded_local": offloaded_elements(model),
    }

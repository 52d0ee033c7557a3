"""A sharded start from a Hugging Face folder: no rank ever holds the whole model.

`from_pretrained` on every FSDP rank would put the whole float32 model in each worker's host
memory before `fully_shard` keeps a slice of it (8 workers of a 70B model: 8 x 280 GB). Here
the model is built with its parameters on the meta device (`skeleton`), sharded as usual, and
only then given storage (`fill_from_folder`): each rank reads, from the folder's safetensors
files, only the rows of each tensor that its shard holds (one contiguous read per tensor into a
buffer of its own, nothing memory-mapped; one file or many under
``model.safetensors.index.json``) and casts them to float32 as it copies them into place. A
process therefore holds its share of the model plus the one slice being read, rank 0
included.

What `from_pretrained` would have done beside the weights is kept:
- Buffers stay real while the model is built (only parameters go to the meta device), so the
  rotary ``inv_freq`` and the like are computed by the model's own constructors, exactly as
  transformers computes them, and are put back after `to_empty`.
- Tied parameters (an LM head that *is* the embedding) are one parameter with one name, read
  once; a checkpoint may hold the tensor under either name.
- A folder whose tensors do not cover the model is refused naming the tensor, as
  `load_hf_model` refuses it.

Where slicing is not possible (``pytorch_model.bin`` checkpoints, which are pickles, or a
model whose checkpoint names transformers rewrites on load) `can_slice` says so and the
replica falls back to the whole load, as before.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sft_runtime.runtime.checkpoint.weight_reader import SAFETENSORS_DTYPES
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.lora.adapters import base_name, is_adapter
from sft_runtime.runtime.policy.hf_files import SAFE_INDEX, SAFE_WEIGHTS, read_safetensors_header
from sft_runtime.runtime.policy.model_path import hf_config, is_local
from sft_runtime.runtime.policy.packed_attention import register_packed_attention


def can_slice(path: str) -> bool:
    """A local folder of safetensors weights whose names transformers keeps as saved."""
    folder = Path(path).expanduser()
    if not is_local(path) or not folder.is_dir():
        return False
    if not ((folder / SAFE_WEIGHTS).is_file() or (folder / SAFE_INDEX).is_file()):
        return False
    config = hf_config(path)
    if getattr(config, "quantization_config", None):
        return False
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        return not get_model_conversion_mapping(model, add_legacy=False)
    except (ImportError, AttributeError, TypeError):
        return True


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While a model is built: each parameter moves to the meta device as it is registered
    (its CPU tensor, never written, is freed at once); buffers are built for real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(
    path: str, *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The model of the folder's config.json with ``dtype`` parameters on the meta device and
    real buffers: what `fill_from_folder` gives storage and weights once it is sharded."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == "sdpa":
        attn_implementation = register_packed_attention()
    config = hf_config(path)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=dtype
        )
    model.generation_config = _generation_config(path, model.generation_config)
    return model


def _generation_config(path: str, default: Any) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:  # the folder has none: transformers derives one from config.json
        return default


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of the checkpoint and the file that holds it."""
    index = folder / SAFE_INDEX
    if (folder / SAFE_WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SAFE_WEIGHTS), framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / SAFE_WEIGHTS)
    weight_map = json.loads(index.read_bytes())["weight_map"]
    return {name: folder / file for name, file in weight_map.items()}


def _checkpoint_name(model: nn.Module, name: str, names: dict[str, Path]) -> str | None:
    """The checkpoint's name for parameter or buffer ``name``: as is, without the base
    model's prefix (older checkpoints), or under a name it is tied to. A layer peft made a
    LoRA layer holds its frozen weight as ``base_layer``, which the base's files do not."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    candidates = [base_name(name)]
    if candidates[0].startswith(prefix):
        candidates.append(candidates[0][len(prefix) :])
    candidates += [a for a in _aliases(model).get(name, ())]
    return next((c for c in candidates if c in names), None)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter shared under several names (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {n: [a for a in names if a != n] for names in by_id.values() for n in names}


def _read_saved_buffers(model: nn.Module, names: dict[str, Path]) -> None:
    """Persistent buffers the checkpoint holds are its values, as `from_pretrained` loads them
    (whole: buffers are small); the others keep what the constructors computed."""
    from safetensors import safe_open

    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            stored = _checkpoint_name(model, full, names)
            if stored is not None:
                with safe_open(str(names[stored]), framework="pt") as f:
                    buffer.copy_(f.get_tensor(stored).to(buffer.dtype))


def _local_slices(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of ``param`` and where it sits in the whole tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    assert tuple(local.shape) == tuple(shape), (local.shape, shape)
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


class _RowReader:
    """Slices of one safetensors file's tensors, read with plain file reads: a run of rows
    (what FSDP's dim-0 shards are) is one contiguous range of bytes, read into a buffer of its
    own. Nothing of the file is memory-mapped, so no page of it counts in this process's
    memory beyond the one buffer; other slicings go through safetensors."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.entries = read_safetensors_header(file)
        self._fh = open(file, "rb")  # noqa: SIM115 - closed by close()
        (header_bytes,) = struct.unpack("<Q", self._fh.read(8))
        self._data = 8 + header_bytes

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read(self, name: str, where: tuple[slice, ...]) -> torch.Tensor:
        entry = self.entries[name]
        dtype = SAFETENSORS_DTYPES.get(entry.dtype)
        whole_rows = all(s == slice(0, n) for s, n in zip(where[1:], entry.shape[1:], strict=True))
        if dtype is None or not where or not whole_rows:
            from safetensors import safe_open

            with safe_open(str(self.file), framework="pt") as f:
                return f.get_slice(name)[where]
        row = math.prod(entry.shape[1:]) * torch.empty((), dtype=dtype).element_size()
        first, last = where[0].start, where[0].stop
        buffer = bytearray((last - first) * row)
        self._fh.seek(self._data + entry.begin + first * row)
        if self._fh.readinto(buffer) != len(buffer):
            raise UserInputError(f"{self.file}: truncated inside tensor {name}")
        return torch.frombuffer(buffer, dtype=dtype).view(last - first, *entry.shape[1:])

    def close(self) -> None:
        self._fh.close()


@torch.no_grad()
def fill_from_folder(model: nn.Module, path: str, device: torch.device) -> dict[str, int]:
    """Storage for the sharded `skeleton` on ``device``, each local shard read from the
    folder's files; returns the elements read here and the model's whole count. LoRA
    adapters are not the folder's: they get storage here and their values from
    `init_adapters` after."""
    folder = Path(path).expanduser()
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])  # as the model's constructors computed them
    names = _tensor_files(folder)
    _read_saved_buffers(model, names)
    wanted: dict[Path, list[tuple[str, str]]] = {}
    absent = []
    for name, _ in model.named_parameters():
        if is_adapter(name):
            continue
        stored = _checkpoint_name(model, name, names)
        if stored is None:
            absent.append(name)
        else:
            wanted.setdefault(names[stored], []).append((name, stored))
    if absent:
        shown = ", ".join(absent[:3]) + (
            f" (and {len(absent) - 3} more)" if len(absent) > 3 else ""
        )
        raise UserInputError(
            f"policy.model_name {path!r}: the folder's weights do not cover the model "
            f"({len(absent)} parameters missing: {shown})"
        )
    params = dict(model.named_parameters())
    read = whole = 0
    for file, pairs in sorted(wanted.items()):
        rows = _RowReader(file)
        try:
            for name, stored in pairs:
                param = params[name]
                local, where = _local_slices(param)
                shape = rows.shape(stored)
                if shape != tuple(param.shape):
                    raise UserInputError(
                        f"policy.model_name {path!r}: {stored} in {file.name} has shape "
                        f"{list(shape)}, the model expects {list(param.shape)}"
                    )
                if local.numel():
                    local.copy_(rows.read(stored, where))  # cast as it copies: no temporary
                read += local.numel()
                whole += param.numel()
        finally:
            rows.close()
    return {"elements_read": read, "elements_whole": whole}

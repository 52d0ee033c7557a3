"""The weight files of a local Hugging Face model folder, checked in the driver before Ray starts.

Why: transformers opens the weights only in each worker's ``from_pretrained``, once Ray and
the workers are up, so a folder without its ``model.safetensors`` fails every worker (exit 1,
pages of tracebacks) and a truncated file can abort one. All that can be wrong shows in the
files' headers (a few KB, even for files of many GB): `check_hf_weights` reads those alone
and refuses a bad folder in one line naming the file (`UserInputError`: exit code 2).

- Present, in transformers' order: ``model.safetensors``, else ``model.safetensors.index.json``
  and every shard its ``weight_map`` names. ``pytorch_model.bin`` (or its index and shards) is
  accepted once it exists: its names and shapes sit in a pickle that cannot be read without
  unpickling it, and the loader's after-load check (`load_hf_model`) still judges them.
- Each header readable and covering its file: a little-endian u64 N, N bytes of JSON, tensors
  whose ``data_offsets`` run end to end from 0 to exactly the data region's size (file size -
  8 - N), each as long as dtype and shape say. A cut anywhere, header included, is caught.
- The index agrees with the shards: a tensor it puts in a shard without it is named.
- Names and shapes fit config.json: the model built on the meta device (no memory) against
  the headers. Every parameter must be there with its shape; of tied parameters (an LM head
  that *is* the embedding) one name will do; buffers may be absent; names without the base
  model's prefix count, as transformers loads them. Extra tensors pass, as they pass the
  loader (transformers drops them with a warning). Where transformers rewrites names or
  shapes on load (a conversion mapping such as fused MoE experts, legacy names, a quantized
  checkpoint) the comparison is left to the loader.

Cost on the suite's tiny Llama (2-core machine): 6-10 ms once transformers' modeling code is
imported; the driver's first call imports it (0.7-0.8 s idle, mostly torch._dynamo).
The header checks run first and need no such import, so a missing or cut file fails fast.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

from sft_runtime.runtime.errors import UserInputError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
WEIGHT_NAMES = (SAFE_WEIGHTS, SAFE_INDEX, TORCH_WEIGHTS, TORCH_INDEX)  # transformers' order
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
SHOWN = 3  # tensors named in one message
# bits per element of each safetensors dtype; an unknown dtype skips the length check
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip


class TensorEntry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def check_hf_weights(path: str, config: Any) -> None:
    """Refuse (`UserInputError`, one line naming the file) a local model folder whose weight
    files are missing, damaged, or do not fit `config` (what `hf_config` read from it)."""
    folder = Path(path).expanduser()
    source = next((folder / n for n in WEIGHT_NAMES if (folder / n).is_file()), None)
    if source is None:
        names = ", ".join(WEIGHT_NAMES[1:])
        raise _bad(folder / SAFE_WEIGHTS, f"no such file, nor {names} beside it")
    weight_map = _weight_map(source) if source.name.endswith(".index.json") else None
    if source.name in (TORCH_WEIGHTS, TORCH_INDEX):  # present; the rest is the loader's
        return
    files = sorted({folder / shard for shard in weight_map.values()}) if weight_map else [source]
    headers = {file: read_safetensors_header(file) for file in files}
    wrong = [f"{t} (in {f})" for t, f in (weight_map or {}).items() if t not in headers[folder / f]]
    if wrong:
        raise _bad(source, f"{len(wrong)} tensors are not in the shard it names: {_shown(wrong)}")
    _check_against_config(source, headers, config)


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file's header lists, after checking that they cover the file
    exactly; reads the header only (8 + N bytes), never the tensor data."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _bad(file, f"truncated: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > MAX_HEADER_BYTES:
            raise _bad(file, f"not a safetensors file (its header length field says {n} bytes)")
        if 8 + n > size:
            raise _bad(file, f"truncated inside its header of {n} bytes (the file has {size})")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:  # UnicodeDecodeError included
        raise _bad(file, f"unreadable header ({exc})") from None
    header.pop("__metadata__", None)
    entries = {name: _entry(file, name, info) for name, info in header.items()}
    _check_offsets(file, entries, size - 8 - n)
    return entries


def _weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map, after checking that every shard it names exists."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        if not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a map of tensor names to files")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _bad(index, f"unreadable index ({type(exc).__name__}: {exc})") from None
    shards = sorted(set(weight_map.values()))
    absent = [str(index.parent / name) for name in shards if not (index.parent / name).is_file()]
    if absent:
        raise _bad(
            index, f"{len(absent)} of its {len(shards)} shards are missing: {_shown(absent)}"
        )
    return weight_map


def _entry(file: Path, name: str, info: Any) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        ints = [*shape, begin, end]
        if not isinstance(dtype, str) or not all(type(i) is int and i >= 0 for i in ints):
            raise TypeError
        if begin > end:
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise _bad(file, f"unreadable header entry for tensor {name}: {info!r:.200}") from None
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_offsets(file: Path, entries: dict[str, TensorEntry], data_bytes: int) -> None:
    """The tensors lie end to end from 0 to exactly ``data_bytes``, each of its own length."""
    past = [name for name, e in entries.items() if e.end > data_bytes]
    if past:
        need = max(e.end for e in entries.values())
        raise _bad(
            file,
            f"truncated: its header needs {need} bytes of tensor data, the file holds "
            f"{data_bytes}; {len(past)} tensors lie past the end: {_shown(past)}",
        )
    cursor = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        bits = _DTYPE_BITS.get(e.dtype)
        if e.begin != cursor or (bits and math.prod(e.shape) * bits != 8 * (e.end - e.begin)):
            span = f"[{e.begin}, {e.end})"
            raise _bad(file, f"damaged header: tensor {name} {e.dtype} {list(e.shape)} at {span}")
        cursor = e.end
    if cursor != data_bytes:
        raise _bad(file, f"{data_bytes - cursor} bytes past the last tensor its header lists")


def _check_against_config(
    source: Path, headers: dict[Path, dict[str, TensorEntry]], config: Any
) -> None:
    model = _meta_model(source, config, [n for entries in headers.values() for n in entries])
    if model is None:
        return
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", "")
    held: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file, entries in headers.items():
        for name, entry in entries.items():  # a base model's names load into ...ForCausalLM
            if name not in expected and prefix and f"{prefix}.{name}" in expected:
                name = f"{prefix}.{name}"
            held.setdefault(name, (file, entry.shape))
    tied: dict[int, list[str]] = {}  # one parameter under several names: one of them will do
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    missing = [names[0] for names in tied.values() if not any(n in held for n in names)]
    config_json = source.parent / "config.json"
    if missing:
        what = f"{len(missing)} tensors that the model of {config_json} needs are in no file"
        raise _bad(source, f"{what}: {_shown(missing)}")
    other = [(n, f, shape) for n, (f, shape) in held.items() if expected.get(n, shape) != shape]
    if other:
        first = other[0][1]
        where = {f: "" if f == first else f" in {f.name}" for _, f, _ in other}
        items = [f"{n} {list(s)} (expected {list(expected[n])}){where[f]}" for n, f, s in other]
        raise _bad(
            first,
            f"{len(other)} tensors of another shape than {config_json} gives: {_shown(items)}",
        )


def _meta_model(source: Path, config: Any, names: list[str]) -> Any:
    """The model `config` describes, on the meta device; None where transformers rewrites
    checkpoint names or shapes on load (see module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    if getattr(config, "quantization_config", None):
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError) as exc:
        reason = f"{type(exc).__name__}: {str(exc).partition(chr(10))[0][:200]}"
        raise _bad(source.parent / "config.json", f"no causal LM to build ({reason})") from None
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            get_model_conversion_mapping,
        )

        if get_model_conversion_mapping(model, add_legacy=False):
            return None
        legacy = [p for r in get_checkpoint_conversion_mapping("legacy") for p in r.source_patterns]
    except (ImportError, AttributeError, TypeError):  # another transformers: compare as saved
        return model
    return None if any(re.search(p, n) for p in legacy for n in names) else model


def _shown(items: list[str]) -> str:
    more = f" (and {len(items) - SHOWN} more)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def _bad(file: Path, what: str) -> UserInputError:
    return UserInputError(f"policy.model_name: {file}: {what}")

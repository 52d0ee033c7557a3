"""`WeightReader`: a checkpoint's weights read a few tensors at a time, never all at once.

The export of a 70B model must not need the model's bytes in host memory. Both layouts a
checkpoint's ``policy/weights`` can have are read by name, lazily: a safetensors folder (one
``model.safetensors`` or the shards its index names) through memory-mapped `safe_open`, and a
sharded (FSDP2) checkpoint through torch.distributed.checkpoint's metadata and a load of just
the keys asked for (its reader fetches each tensor's byte ranges from the rank files, so the
other tensors are never read). What the reader holds between calls is the metadata only.
Sharded folders are read through `safe_dcp`, whose allow-list keeps a crafted file from
running code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from sft_runtime.runtime.checkpoint import sharded
from sft_runtime.runtime.errors import UserInputError

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
SHARDED_PREFIX = "model."  # the key prefix of the weights in a sharded checkpoint


def read_all(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a weights folder, whole (a sharded checkpoint's consolidated)."""
    reader = WeightReader(directory)
    return reader.read(list(reader.specs))


class WeightReader:
    """The tensors of one weights folder: ``specs`` (name -> dtype and shape, in the
    checkpoint's order) at once, the values on `read`."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.sharded = sharded.is_sharded(self.directory)
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._files: dict[str, Path] = {}
        if self.sharded:
            self._read_dcp_metadata()
        else:
            self._read_safetensors_headers()

    def nbytes(self, name: str, dtype: torch.dtype | None = None) -> int:
        """Bytes of tensor ``name`` stored as ``dtype`` (default: as saved)."""
        saved, shape = self.specs[name]
        count = 1
        for n in shape:
            count *= n
        target = dtype if dtype is not None and saved.is_floating_point else saved
        return count * torch.empty((), dtype=target).element_size()

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The whole tensors ``names``, in that order."""
        if self.sharded:
            return self._read_dcp(names)
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._files[name], []).append(name)
        for file, wanted in by_file.items():
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in wanted:
                        out[name] = f.get_tensor(name)
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
                raise UserInputError(f"{file}: unreadable weights ({exc})") from exc
        return {name: out[name] for name in names}

    # ------------------------------------------------------------------ layouts
    def _read_safetensors_headers(self) -> None:
        from safetensors import safe_open

        index = self.directory / WEIGHTS_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise UserInputError(f"{index}: unreadable weight index ({exc})") from None
            files = sorted({self.directory / f for f in weight_map.values()})
        else:
            files = [self.directory / WEIGHTS_FILE]
        for file in files:
            if not file.is_file():
                raise UserInputError(f"checkpoint weights not found: {file}")
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        part = f.get_slice(name)
                        dtype = SAFETENSORS_DTYPES[part.get_dtype()]
                        self.specs[name] = (dtype, tuple(part.get_shape()))
                        self._files[name] = file
            except UserInputError:
                raise
            except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
                raise UserInputError(f"{file}: unreadable weights ({exc})") from exc

    def _read_dcp_metadata(self) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from sft_runtime.runtime.checkpoint import safe_dcp

        metadata = safe_dcp.read_metadata(self.directory)  # the allow-list: runs no code
        for key, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata) and key.startswith(SHARDED_PREFIX):
                name = key.removeprefix(SHARDED_PREFIX)
                self.specs[name] = (meta.properties.dtype, tuple(meta.size))

    def _read_dcp(self, names: list[str]) -> dict[str, torch.Tensor]:
        from sft_runtime.runtime.checkpoint import safe_dcp

        state = {
            SHARDED_PREFIX + name: torch.empty(self.specs[name][1], dtype=self.specs[name][0])
            for name in names
        }
        safe_dcp.load(state, self.directory, no_dist=True)  # one process, no process group
        return {name: state[SHARDED_PREFIX + name] for name in names}


SAFETENSORS_DTYPES = {  # a safetensors header's dtype names
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

"""A picklable loader factory that the controller can build without importing torch.

The controller ships one factory per logical DP shard to the loader owners. Naming the
`ColocatedLoader` class directly would import torch and energon into the controller (about
2 s and 250 MB) only to pickle a reference; this function imports them in the worker.
"""

from __future__ import annotations

from typing import Any

from sft_runtime.runtime.data.config import LoaderSpec


def build_colocated_loader(
    spec: LoaderSpec, logical_rank: int, logical_world_size: int, placement_hash: str
) -> Any:
    """A `ColocatedLoader` for one logical DP rank (called inside the owning worker)."""
    from sft_runtime.runtime.data.loader import ColocatedLoader

    return ColocatedLoader(spec, logical_rank, logical_world_size, placement_hash)

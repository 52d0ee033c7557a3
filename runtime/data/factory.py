"""A picklable loader factory that the controller can build without importing torch.

The controller ships one factory per loader owner: for one data shard, or for the group of
shards it loads (`runtime.data.shards`). Naming the
`ColocatedLoader` class directly would import torch and energon into the controller (about
2 s and 250 MB) only to pickle a reference; this function imports them in the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from sft_runtime.runtime.data.config import LoaderSpec
from sft_runtime.runtime.data.placement import DataLoaderPlacementPlan


def build_colocated_loader(
    spec: LoaderSpec, logical_rank: int, logical_world_size: int, placement_hash: str
) -> Any:
    """A `ColocatedLoader` for one logical DP rank (called inside the owning worker)."""
    from sft_runtime.runtime.data.loader import ColocatedLoader

    return ColocatedLoader(spec, logical_rank, logical_world_size, placement_hash)


def build_shard_group(
    spec: LoaderSpec, logical_ranks: list[int], logical_world_size: int, placement_hash: str
) -> Any:
    """A `ShardGroupLoader` of the shards ``logical_ranks`` (one `ColocatedLoader` each)."""
    from sft_runtime.runtime.data.shards import ShardGroupLoader

    return ShardGroupLoader(
        [
            partial(build_colocated_loader, spec, rank, logical_world_size, placement_hash)
            for rank in logical_ranks
        ]
    )


def loader_factory(spec: LoaderSpec, plan: DataLoaderPlacementPlan, owner: int) -> Callable:
    """What ``owner`` builds its loader with: one shard's loader, or a group of its shards."""
    shards = plan.shards_of(owner)
    world, hash_ = plan.logical_world_size, plan.placement_hash
    if len(shards) == 1:
        return partial(build_colocated_loader, spec, shards[0], world, hash_)
    return partial(build_shard_group, spec, shards, world, hash_)


def owned_states(plan: DataLoaderPlacementPlan, states: list | None) -> list | None:
    """The saved per-shard states (one per logical rank) dealt to the owners: one state for
    an owner of one shard, a list for an owner of several."""
    if states is None:
        return None
    dealt: list[Any] = []
    for owner in plan.owner_ranks:
        mine = [states[shard] for shard in plan.shards_of(owner)]
        dealt.append(mine[0] if len(mine) == 1 else mine)
    return dealt

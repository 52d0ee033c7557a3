"""Which worker owns each logical DP rank's loader, and which workers receive its batch.

A sharding layout is an ordered mapping of axis name -> size; global ranks are row-major over
that order. Only ``data_parallel`` splits the data: every rank of one DP lane (same DP
coordinate, any tensor/pipeline/context coordinates) trains on the same batch, so the lane gets
one loader copy, owned by the lane's rank at coordinate 0 on every replicated axis and delivered
to all ranks of the lane.

With ``shards`` G (``data.elastic.shards``) the data is cut into G logical ranks, whatever the
DP size W: lane w owns the contiguous block of G/W shards from w*G/W. The plan's hash is the
hash of the layout with G lanes, so it names the data's cut, not the workers: it is today's
hash when G = W, and the same for every W that divides G. It goes into checkpoints and loader
fingerprints: a resume under a different cut is detected instead of silently reshuffling data.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass

DATA_PARALLEL = "data_parallel"
REPLICATED_AXES = ("tensor_parallel", "pipeline_parallel", "context_parallel")
KNOWN_AXES = (DATA_PARALLEL, *REPLICATED_AXES)
MAPPERS = ("default",)


@dataclass(frozen=True)
class LoaderCopy:
    """One logical DP rank's loader: who builds it and who trains on its batches."""

    logical_rank: int
    logical_world_size: int
    owner_rank: int
    delivery_ranks: tuple[int, ...]


@dataclass(frozen=True)
class DataLoaderPlacementPlan:
    """All loader copies of a run, in logical-rank order, with the layout's hash."""

    copies: tuple[LoaderCopy, ...]
    placement_hash: str

    @property
    def logical_world_size(self) -> int:
        return len(self.copies)

    @property
    def owner_ranks(self) -> list[int]:
        """The ranks that own loaders, once each, in shard order."""
        return list(dict.fromkeys(c.owner_rank for c in self.copies))

    def shards_of(self, owner_rank: int) -> list[int]:
        """The logical ranks (shards) ``owner_rank`` loads, in order."""
        return [c.logical_rank for c in self.copies if c.owner_rank == owner_rank]

    @property
    def shard_map(self) -> list[list[int]]:
        """The shards of each owner, in owner order (what `placement_changed` records)."""
        return [self.shards_of(owner) for owner in self.owner_ranks]

    def copy_for_logical_rank(self, logical_rank: int) -> LoaderCopy:
        if not 0 <= logical_rank < len(self.copies):
            raise ValueError(f"logical rank {logical_rank} out of range [0, {len(self.copies)})")
        return self.copies[logical_rank]


def _validate(sharding: Mapping[str, int], mapper: str) -> dict[str, int]:
    if mapper not in MAPPERS:
        raise ValueError(f"unknown topology mapper {mapper!r}; expected one of {list(MAPPERS)}")
    if not isinstance(sharding, Mapping) or not sharding:
        raise ValueError("sharding layout must be a non-empty mapping of axis name -> size")
    layout: dict[str, int] = {}
    for axis, size in sharding.items():
        if axis not in KNOWN_AXES:
            raise ValueError(f"unknown sharding axis {axis!r}; expected one of {list(KNOWN_AXES)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"sharding axis {axis!r} must have an integer size >= 1, got {size!r}")
        layout[axis] = size
    if DATA_PARALLEL not in layout:
        raise ValueError(f"sharding layout has no {DATA_PARALLEL!r} axis: {dict(sharding)}")
    return layout


def build_placement_plan(
    sharding: Mapping[str, int], mapper: str = "default", shards: int | None = None
) -> DataLoaderPlacementPlan:
    """One loader copy per shard (default: per DP lane) of the row-major layout `sharding`,
    each owned by its lane (see module docstring). ValueError when the DP size does not
    divide ``shards``."""
    layout = _validate(sharding, mapper)
    lanes = _lane_plan(layout, mapper)
    workers = layout[DATA_PARALLEL]
    if shards is None or shards == workers:
        return lanes
    if shards < 1 or shards % workers:
        raise ValueError(
            f"{workers} data-parallel workers do not divide data.elastic.shards={shards}"
        )
    per_lane = shards // workers
    logical = _lane_plan({**layout, DATA_PARALLEL: shards}, mapper)
    copies = tuple(
        LoaderCopy(
            logical_rank=shard,
            logical_world_size=shards,
            owner_rank=lanes.copies[shard // per_lane].owner_rank,
            delivery_ranks=lanes.copies[shard // per_lane].delivery_ranks,
        )
        for shard in range(shards)
    )
    return DataLoaderPlacementPlan(copies=copies, placement_hash=logical.placement_hash)


def _lane_plan(layout: dict[str, int], mapper: str) -> DataLoaderPlacementPlan:
    axes = list(layout)
    sizes = [layout[a] for a in axes]
    dp_index = axes.index(DATA_PARALLEL)
    strides = [1] * len(axes)
    for i in range(len(axes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]

    dp_size = layout[DATA_PARALLEL]
    lanes: list[list[int]] = [[] for _ in range(dp_size)]
    for coords in itertools.product(*(range(n) for n in sizes)):
        rank = sum(c * s for c, s in zip(coords, strides, strict=True))
        lanes[coords[dp_index]].append(rank)
    copies = tuple(
        LoaderCopy(
            logical_rank=dp,
            logical_world_size=dp_size,
            owner_rank=dp * strides[dp_index],
            delivery_ranks=tuple(sorted(lane)),
        )
        for dp, lane in enumerate(lanes)
    )
    canonical = {
        "mapper": mapper,
        "axes": axes,
        "shape": sizes,
        "copies": [
            [c.logical_rank, c.logical_world_size, c.owner_rank, list(c.delivery_ranks)]
            for c in copies
        ],
    }
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return DataLoaderPlacementPlan(copies=copies, placement_hash=hashlib.sha256(blob).hexdigest())

"""A resume on another number of workers: what may change, what may not, and the record of it.

The data is cut into ``data.elastic.shards`` G shards when a run starts (left out: its
data-parallel size W then), and G never changes: each shard's saved loader state continues
its own sample stream. The workers W may change on a resume to any number that divides G,
and each takes G/W whole shards (`runtime.data.placement`). Both are refused here, before Ray
starts, naming the key: a changed G, and a W that does not divide it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_runtime.runtime.config import MasterConfig
from sft_runtime.runtime.errors import UserInputError

SHARDS_KEY = "data.elastic.shards"
WORKER_KEYS = ("cluster.num_nodes", "cluster.workers_per_node")


def _known(value: Any) -> Any:
    return None if isinstance(value, str) else value  # `MISSING` in an older config


def saved_shards(flat: dict[str, Any]) -> int:
    """The shards of a run whose config (dotted keys) is ``flat``: the key, or its W."""
    shards = _known(flat.get(SHARDS_KEY))
    if shards is not None:
        return int(shards)
    return int(_known(flat.get("cluster.num_nodes")) or 1) * int(
        _known(flat.get("cluster.workers_per_node")) or 1
    )


def check_placement(checkpoint: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Refuse a resume from ``checkpoint`` (configs as dotted keys) that changes the shards
    or runs on a number of workers that does not divide them; resolve ``new``'s shards to
    the saved ones, so that a key left out compares equal."""
    shards = saved_shards(old)
    old[SHARDS_KEY] = shards
    asked = _known(new.get(SHARDS_KEY))
    if asked is not None and asked != shards:
        raise UserInputError(
            f"{checkpoint}: {SHARDS_KEY}: {shards} -> {asked}: the data's shards are fixed "
            f"when a run starts (each continues its own sample stream); resume with "
            f"{SHARDS_KEY}={shards}, or start a new run directory"
        )
    new[SHARDS_KEY] = shards
    workers = int(new["cluster.num_nodes"]) * int(new["cluster.workers_per_node"])
    if shards % workers:
        divisors = [n for n in range(1, shards + 1) if shards % n == 0]
        raise UserInputError(
            f"{checkpoint}: {workers} data-parallel workers (cluster.num_nodes x "
            f"cluster.workers_per_node) do not divide the run's {SHARDS_KEY}={shards}; "
            f"resume on {', '.join(map(str, divisors))} workers"
        )


def run_shards(config: MasterConfig, resume: Any) -> int:
    """The run's G: the key, the checkpoint's (one loader state per shard), or W at start."""
    if config.data.elastic.shards is not None:
        return config.data.elastic.shards
    if resume.step and resume.loader_states:
        return len(resume.loader_states)
    return config.cluster.world_size


def with_shards(config: MasterConfig, shards: int) -> MasterConfig:
    """``config`` with its shards stated, so every checkpoint's config.yaml holds them."""
    elastic = config.data.elastic.model_copy(update={"shards": shards})
    return config.model_copy(update={"data": config.data.model_copy(update={"elastic": elastic})})


@dataclass(frozen=True)
class WorkersChange:
    """The workers of the checkpoint's run and of this attempt (from the config's changes)."""

    old_world_size: int
    new_world_size: int


def workers_change(config: MasterConfig, changes: dict[str, list[Any]]) -> WorkersChange | None:
    """How W changed since the checkpoint, read off the recorded config changes."""
    if not any(key in changes for key in WORKER_KEYS):
        return None
    cluster = config.cluster
    now = {
        "cluster.num_nodes": cluster.num_nodes,
        "cluster.workers_per_node": cluster.workers_per_node,
    }
    was = {key: changes.get(key, [value])[0] for key, value in now.items()}
    old = int(was["cluster.num_nodes"]) * int(was["cluster.workers_per_node"])
    new = cluster.world_size
    return None if old == new else WorkersChange(old, new)

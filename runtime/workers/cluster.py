"""The placement group that reserves one bundle per policy worker.

A placement group outlives whoever made it and keeps its resources, so every path out of
`create_placement_group` either returns a ready group or removes it; a group that cannot
be placed fails after ``cluster.placement_timeout_s`` with the resources it asked for and
what the cluster has, instead of waiting forever.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from sft_runtime.runtime.policy.cluster_config import ClusterConfig


class PlacementError(RuntimeError):
    """The placement group could not be placed in time."""


def worker_bundle(cluster: ClusterConfig) -> dict[str, float]:
    """Resources of one worker's bundle (fractional CPUs allowed)."""
    bundle = {"CPU": float(cluster.cpus_per_worker)}
    if cluster.gpus_per_worker:
        bundle["GPU"] = float(cluster.gpus_per_worker)
    return bundle


def create_placement_group(cluster: ClusterConfig, *, name: str = "") -> PlacementGroup:
    """Reserve ``num_nodes * workers_per_node`` bundles and wait until they are placed."""
    bundles = [worker_bundle(cluster) for _ in range(cluster.world_size)]
    pg = placement_group(bundles, strategy=cluster.placement_strategy, name=name)
    try:
        ready = pg.wait(timeout_seconds=cluster.placement_timeout_s)
    except BaseException:
        remove_placement_group_quietly(pg)
        raise
    if not ready:
        remove_placement_group_quietly(pg)
        raise PlacementError(_missing_resources_message(cluster, bundles))
    return pg


def remove_placement_group_quietly(pg: PlacementGroup | None) -> None:
    """Remove a placement group; a group already gone is not an error."""
    if pg is None:
        return
    try:
        remove_placement_group(pg)
    except Exception:  # cleanup must never hide the original error
        pass


def _missing_resources_message(cluster: ClusterConfig, bundles: list[dict[str, float]]) -> str:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    total = ray.cluster_resources()
    free = ray.available_resources()
    short = [
        f"{k}: need {v:g}, cluster has {total.get(k, 0.0):g} ({free.get(k, 0.0):g} free)"
        for k, v in need.items()
        if free.get(k, 0.0) < v
    ] or ["resources exist in total but no placement satisfies the strategy"]
    return (
        f"placement group of {len(bundles)} bundle(s) {bundles[0]} with strategy "
        f"{cluster.placement_strategy} was not placed within "
        f"cluster.placement_timeout_s={cluster.placement_timeout_s:g}s; "
        + "; ".join(short)
        + " (check cluster.num_nodes, cluster.workers_per_node, cluster.cpus_per_worker, "
        "cluster.gpus_per_node)"
    )

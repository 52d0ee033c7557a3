"""What the log proves about the data shards: each step trained every shard once, and a
change of workers dealt every shard to exactly one of them.

A step's ``sample_digests`` hold one digest per data shard (``data.elastic.shards``, the
``logical_world_size`` of its attempt's ``run_started``), in shard order, whatever the
number of workers that loaded them: that is what makes the digests of a run comparable
across a resume on another number of workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sft_runtime.events.schemas import Record


@dataclass
class ShardReport:
    """`check_shards`'s findings: lines to print and problems (empty: all held)."""

    shards: set[int] = field(default_factory=set)
    steps: int = 0
    changes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        counts = ", ".join(map(str, sorted(self.shards))) or "-"
        out = [f"shards: {counts} per step, {self.steps} committed steps checked"]
        out += [f"placement changed: {change}" for change in self.changes]
        return out


def check_shards(records: Iterable[Record]) -> ShardReport:
    """Every committed step has one digest per shard of its attempt; every placement change
    keeps the shards and deals each to one worker."""
    report = ShardReport()
    shards: dict[int, int] = {}  # attempt -> its logical_world_size
    for rec in records:
        data = rec.data
        if rec.type == "run_started" and data.get("logical_world_size"):
            shards[rec.attempt] = int(data["logical_world_size"])
        elif rec.type == "step_committed":
            expected = shards.get(rec.attempt)
            digests = data.get("sample_digests") or []
            report.steps += 1
            if expected is None or not digests:
                continue  # an older log that did not record them
            report.shards.add(len(digests))
            if len(digests) != expected:
                report.problems.append(
                    f"step {data['step']} (attempt {rec.attempt}): {len(digests)} shard "
                    f"digests for {expected} shards"
                )
        elif rec.type == "placement_changed":
            expected = shards.get(rec.attempt)
            dealt = sorted(s for worker in data["shard_map"] for s in worker)
            at = f"attempt {rec.attempt} at step {data['resumed_from_step']}"
            report.changes.append(
                f"{at}: {data['old_world_size']} -> {data['new_world_size']} workers, "
                f"shards {data['shard_map']}"
            )
            if expected != data["shards"] or dealt != list(range(data["shards"])):
                report.problems.append(
                    f"{at}: shards {data['shard_map']} are not each of the run's "
                    f"{expected} shards once"
                )
            if len(data["shard_map"]) != data["new_world_size"]:
                report.problems.append(
                    f"{at}: {len(data['shard_map'])} workers' shards for "
                    f"{data['new_world_size']} workers"
                )
    return report

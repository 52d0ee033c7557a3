"""The ``cluster`` section: where the policy workers run and how long they are waited for.

A concern apart from the policy's own keys: it decides the placement (nodes, workers a node,
GPUs, CPUs), the process settings (threads, niceness) and the timeouts, none of which
changes what a step computes except through the number of data-parallel workers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from sft_runtime.runtime.policy.config import STRICT


class ClusterConfig(BaseModel):
    """Where the workers run: one placement-group bundle per DP worker."""

    model_config = STRICT

    address: str | None = None
    num_nodes: int = Field(1, ge=1)
    workers_per_node: int = Field(2, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0.0)
    gpus_per_node: int = Field(0, ge=0)  # left out: see _workers_follow_gpus
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"
    num_threads_per_worker: int = Field(1, ge=1)
    dist_timeout_s: float = Field(60.0, gt=0.0)
    call_timeout_s: float = Field(300.0, gt=0.0)
    placement_timeout_s: float = Field(60.0, gt=0.0)
    connect_timeout_s: float = Field(10.0, gt=0.0)
    # Ray starts workers at niceness 15, so on a busy machine any other process starves the
    # controller and the training step; they run at this value where permitted (None keeps
    # Ray's). See process/niceness.py.
    worker_niceness: int | None = Field(0, ge=-20, le=19)

    @model_validator(mode="before")
    @classmethod
    def _workers_follow_gpus(cls, data: Any) -> Any:
        """NeMo RL runs one worker per GPU: ``gpus_per_node: N`` alone means N workers a
        node. ``workers_per_node`` is ours, for CPU workers (``gpus_per_node: 0``). Left
        out, ``gpus_per_node`` is NeMo RL's 1 (or a GPU for each of ``workers_per_node``)
        where this machine has a GPU, and 0 where it has none (NeMo RL's value cannot run
        there)."""
        if not isinstance(data, dict):
            return data
        if data.get("gpus_per_node") is None:
            gpus = (data.get("workers_per_node") or 1) if _gpu_visible() else 0
            data = {**data, "gpus_per_node": gpus}
        if data["gpus_per_node"] and data.get("workers_per_node") is None:
            return {**data, "workers_per_node": data["gpus_per_node"]}
        return data

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.gpus_per_node not in (0, self.workers_per_node):
            raise ValueError(
                f"cluster.gpus_per_node={self.gpus_per_node} runs one worker per GPU, but "
                f"cluster.workers_per_node={self.workers_per_node}: leave workers_per_node "
                "out (it follows gpus_per_node), or set gpus_per_node=0 for CPU workers"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.workers_per_node

    @property
    def gpus_per_worker(self) -> int:
        return 1 if self.gpus_per_node else 0


def _gpu_visible() -> bool:
    import torch  # noqa: PLC0415 - the config module stays importable without touching CUDA

    return torch.cuda.is_available()

"""``policy.dtensor_cfg.cpu_offload: true`` on 2 FSDP2 workers (real local Ray, real gloo).

The same synthetic batches and config as test_fsdp.py, sharded over 2 CPU workers once with
and once without the offload: every rank reports its parameter shards held in host memory
by FSDP2's `CPUOffloadPolicy` (none without), and because a CPU device moves nothing, the two
runs' losses, gradient norms and final weights are equal bit for bit. The offloaded run's
step-3 checkpoint (torch.distributed.checkpoint shards of offloaded parameters and AdamW
moments) resumed in a fresh offloaded group reproduces steps 4-6 bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from sft_runtime.runtime.workers.group import PolicyWorkerGroup
from tests.support import worker_probes
from tests.support.policy_steps import factories, one_step

STEPS, SAVE_AT, WORLD = 6, 3, 2


def _policy(policy_cfg, cpu_offload: bool):
    return type(policy_cfg).model_validate(
        {
            **policy_cfg.model_dump(),
            "precision": "float32",  # pinned: the defaults move to NeMo RL's (bfloat16)
            "dtensor_cfg": {"enabled": True, "cpu_offload": cpu_offload},
        }
    )


def _train(policy, cluster_cfg, name: str, ckpt=None) -> dict:
    group = PolicyWorkerGroup(policy, cluster_cfg, seed=0, name=name)
    try:
        group.setup_loaders(factories(WORLD))
        steps, loader_states = [], None
        for step in range(1, STEPS + 1):
            steps.append(one_step(group))
            if ckpt is not None and step == SAVE_AT:
                group.save_checkpoint(str(ckpt / "weights"), str(ckpt / "optimizer"), None, False)
                loader_states = worker_probes.loader_states(group)
        return {
            "steps": steps,
            "storage": worker_probes.local_storage(group),
            "weights": worker_probes.weights(group)[0],
            "loader_states": loader_states,
        }
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def runs(ray_session, policy_cfg, cluster_cfg, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("offload_ckpt") / f"step_{SAVE_AT}" / "policy"
    offloaded = _train(_policy(policy_cfg, True), cluster_cfg, "test-offload", ckpt)
    plain = _train(_policy(policy_cfg, False), cluster_cfg, "test-offload-plain")
    return {"offloaded": offloaded, "plain": plain, "ckpt": ckpt}


def _figures(run: dict) -> list[tuple[float, float]]:
    return [(s[0].loss, s[0].grad_norm) for s in run["steps"]]


def test_every_rank_holds_its_parameter_shards_in_host_memory(runs):
    for storage in runs["offloaded"]["storage"]:
        assert storage["params_offloaded_local"] == storage["params_local"] > 0
        assert storage["params_local"] < storage["params_full"]  # sharded, not whole
    assert all(s["params_offloaded_local"] == 0 for s in runs["plain"]["storage"])


def test_offloaded_training_equals_the_run_without_offload_bit_for_bit(runs):
    offloaded, plain = runs["offloaded"], runs["plain"]
    assert _figures(offloaded) == _figures(plain)
    for rank_steps in offloaded["steps"]:  # every rank reports the same global figures
        assert rank_steps[0].loss == rank_steps[1].loss
        assert rank_steps[0].grad_norm == rank_steps[1].grad_norm > 0
    assert sorted(offloaded["weights"]) == sorted(plain["weights"])
    assert all(torch.equal(offloaded["weights"][k], v) for k, v in plain["weights"].items())


def test_resume_from_an_offloaded_checkpoint_is_bitwise_exact(runs, policy_cfg, cluster_cfg):
    ckpt, offloaded = runs["ckpt"], runs["offloaded"]
    restore = {"weights_path": str(ckpt / "weights"), "optimizer_path": str(ckpt / "optimizer")}
    policy = _policy(policy_cfg, True)
    group = PolicyWorkerGroup(
        policy, cluster_cfg, seed=123, name="test-offload-resumed", restore=restore
    )
    try:
        group.setup_loaders(factories(WORLD), offloaded["loader_states"])
        steps = [one_step(group) for _ in range(STEPS - SAVE_AT)]
        weights = worker_probes.weights(group)[0]
    finally:
        group.shutdown()
    assert [(s[0].loss, s[0].grad_norm) for s in steps] == _figures(offloaded)[SAVE_AT:]
    assert all(torch.equal(weights[k], v) for k, v in offloaded["weights"].items())

"""FSDP2 policy workers (``policy.dtensor_cfg.enabled``) on a real local Ray with real gloo.

The same synthetic batches and config as the data-parallel tests, sharded over 2 CPU
workers: losses agree with the single-process ground truth (which the DP group matches to
1e-6) within 1e-5 over 10 steps; each rank stores half of the parameters, gradients and
AdamW moments (read from the DTensor shards); the step-5 checkpoint is written by both ranks
with torch.distributed.checkpoint, consolidates to the weights the group had, and a fresh
sharded group resumed from it reproduces steps 6-10 bit for bit. An aborted step and a loss
that fails on one rank leave weights and optimizer bitwise unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

from sft_runtime.runtime.checkpoint.policy_files import load_weights
from sft_runtime.runtime.checkpoint.sharded import TRAINER_STATE, is_sharded
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.workers.group import PolicyWorkerError, PolicyWorkerGroup
from tests.support import sources, worker_probes
from tests.support.policy_steps import (
    assert_tree_equal,
    factories,
    one_step,
    reference_losses,
    start_step,
)

STEPS, SAVE_AT, WORLD = 10, 5, 2


@pytest.fixture(scope="module")
def fsdp_policy(policy_cfg):
    return type(policy_cfg).model_validate(
        {**policy_cfg.model_dump(), "dtensor_cfg": {"enabled": True}}
    )


@pytest.fixture(scope="module")
def sharded(ray_session, fsdp_policy, cluster_cfg, tmp_path_factory):
    """10 sharded steps; step 1 phase by phase (storage read with its gradients), a
    checkpoint after step 5."""
    ckpt = tmp_path_factory.mktemp("fsdp_ckpt") / "step_5" / "policy"
    group = PolicyWorkerGroup(fsdp_policy, cluster_cfg, seed=0, name="test-fsdp")
    try:
        group.setup_loaders(factories(WORLD))
        group.prepare_for_training()
        start_step(group)
        storage_in_step = worker_probes.local_storage(group)
        steps = [group.wait(group.send_finish())]
        group.commit_batches()
        storage_after = worker_probes.local_storage(group)
        for step in range(2, STEPS + 1):
            steps.append(one_step(group))
            if step == SAVE_AT:
                group.save_checkpoint(str(ckpt / "weights"), str(ckpt / "optimizer"), None, False)
                loader_states = worker_probes.loader_states(group)
                weights_at_save = worker_probes.weights(group)[0]
        yield {
            "group": group,
            "steps": steps,
            "ckpt": ckpt,
            "loader_states": loader_states,
            "weights_at_save": weights_at_save,
            "weights": worker_probes.weights(group),
            "storage": (storage_in_step, storage_after),
        }
    finally:
        group.shutdown()


def test_sharded_training_matches_the_unsharded_ground_truth(sharded, policy_cfg):
    ref_losses, ref_weights = reference_losses(policy_cfg, STEPS, WORLD)
    losses = [s[0].loss for s in sharded["steps"]]
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)
    for rank_steps in sharded["steps"]:  # every rank reports the same global figures
        assert rank_steps[0].loss == rank_steps[1].loss
        assert rank_steps[0].grad_norm == rank_steps[1].grad_norm
        assert 0 < rank_steps[0].grad_norm < 100
    w0, w1 = sharded["weights"]
    assert sorted(w0) == sorted(ref_weights)
    for name, ref in ref_weights.items():
        assert torch.equal(w0[name], w1[name])
        torch.testing.assert_close(w0[name], ref, rtol=1e-4, atol=1e-5)


def test_each_rank_stores_a_world_share_of_the_model(sharded):
    in_step, after = sharded["storage"]
    full = in_step[0]["params_full"]
    assert full > 10_000 and all(s["params_full"] == full for s in in_step + after)
    for kind, storage in (("params", in_step), ("grads", in_step), ("optimizer", after)):
        total = storage[0][f"{kind}_full"]
        assert total == (2 * full if kind == "optimizer" else full)  # AdamW: two moments
        local = [s[f"{kind}_local"] for s in storage]
        assert sum(local) == total, kind  # the shards cover the model exactly once
        assert max(local) <= math.ceil(total / WORLD) * 1.05, (kind, local)


def test_the_sharded_checkpoint_is_written_by_every_rank_and_consolidates(sharded):
    ckpt = sharded["ckpt"]
    for part in ("weights", "optimizer"):
        assert is_sharded(ckpt / part)
        shards = sorted(p.name for p in (ckpt / part).glob("*.distcp"))
        assert shards == [f"__{r}_0.distcp" for r in range(WORLD)], shards
    state = torch.load(ckpt / "optimizer" / TRAINER_STATE, weights_only=True)
    assert state["scheduler"]["steps_done"] == SAVE_AT
    whole = load_weights(ckpt / "weights")
    want = sharded["weights_at_save"]
    assert sorted(whole) == sorted(want)
    assert all(torch.equal(whole[k], want[k]) for k in want)


def test_resume_from_the_sharded_checkpoint_is_bitwise_exact(
    sharded, fsdp_policy, cluster_cfg, policy_cfg
):
    ckpt = sharded["ckpt"]
    restore = {"weights_path": str(ckpt / "weights"), "optimizer_path": str(ckpt / "optimizer")}
    group = PolicyWorkerGroup(
        fsdp_policy, cluster_cfg, seed=123, name="test-fsdp-resumed", restore=restore
    )
    try:
        group.setup_loaders(factories(WORLD), sharded["loader_states"])
        steps = [one_step(group) for _ in range(STEPS - SAVE_AT)]
        weights = worker_probes.weights(group)[0]
    finally:
        group.shutdown()
    assert [s[0].loss for s in steps] == [s[0].loss for s in sharded["steps"][SAVE_AT:]]
    assert [s[0].grad_norm for s in steps] == [s[0].grad_norm for s in sharded["steps"][SAVE_AT:]]
    want = sharded["weights"][0]
    assert all(torch.equal(weights[k], want[k]) for k in want)
    # an unsharded group refuses the sharded files instead of misreading them
    with pytest.raises(UserInputError, match="policy.dtensor_cfg.enabled=true"):
        PolicyWorkerGroup(policy_cfg, cluster_cfg, name="test-fsdp-wrong", restore=restore)


def test_abort_and_a_failing_loss_leave_the_shards_bitwise_unchanged(sharded):
    group = sharded["group"]
    before_w, before_o = worker_probes.weights(group), worker_probes.optimizer_state(group)
    envelopes = [o.envelope for o in start_step(group)]
    group.abort_train_step()
    group.abort_batches()
    # a loss that raises on rank 1 after its forward: both ranks fail the start together
    # (no process-group timeout), the finish refuses, the step is aborted
    started = group.send_start(sources.LossFailingOnRank(1), False)
    finish = group.send_finish()
    with pytest.raises(PolicyWorkerError, match="loss blew up on rank 1") as info:
        group.wait(started)
    assert info.value.phase == "train" and 1 in info.value.ranks
    with pytest.raises(PolicyWorkerError, match="no trained step|before a successful"):
        group.wait(finish)
    group.abort_train_step()
    group.abort_batches()
    after_w, after_o = worker_probes.weights(group), worker_probes.optimizer_state(group)
    for b, a in zip(before_w, after_w, strict=True):
        assert sorted(b) == sorted(a) and all(torch.equal(b[k], a[k]) for k in b)
    for b, a in zip(before_o, after_o, strict=True):
        assert_tree_equal(b, a)
    # the aborted batch comes again and trains normally
    assert start_step(group)[0].envelope.source_ids == envelopes[0].source_ids
    results = group.wait(group.send_finish())
    group.commit_batches()
    assert results[0].step == STEPS + 1 and math.isfinite(results[0].loss)


def test_a_replicate_by_shard_mesh_trains_like_the_ground_truth(
    ray_session, policy_cfg, cluster_cfg
):
    """``dp_replicate_size: 2`` over 2 workers: a 2 x 1 mesh (HSDP), each rank a whole replica
    whose gradients are all-reduced over the replicate dimension."""
    policy = type(policy_cfg).model_validate(
        {**policy_cfg.model_dump(), "dtensor_cfg": {"enabled": True, "dp_replicate_size": 2}}
    )
    group = PolicyWorkerGroup(policy, cluster_cfg, seed=0, name="test-hsdp")
    try:
        group.setup_loaders(factories(WORLD))
        steps = [one_step(group) for _ in range(3)]
        storage = worker_probes.local_storage(group)
    finally:
        group.shutdown()
    ref_losses, _ = reference_losses(policy_cfg, 3, WORLD)
    assert [s[0].loss for s in steps] == pytest.approx(ref_losses, rel=1e-5, abs=0)
    assert all(s["params_local"] == s["params_full"] for s in storage)  # replicated, not split

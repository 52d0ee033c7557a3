"""Data-parallel policy workers on a real local Ray with real gloo (2 CPU workers).

One worker group trains 10 steps straight (checkpointing after step 5) and is compared
with a single process trained on the same global batches; a second, fresh group resumes
from the step-5 checkpoint and must reproduce steps 6-10 bit for bit. The abort and
dead-worker tests reuse those groups, the latter last, since it breaks its group.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import ray
import torch
from ray.util import placement_group_table
from safetensors.torch import load_file

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy.loss import NLLLossFn
from sft_runtime.runtime.process.heap import worker_heap_env
from sft_runtime.runtime.workers.cluster import PlacementError
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
def straight(ray_session, policy_cfg, cluster_cfg, tmp_path_factory):
    """10 steps straight on a 2-worker group, a checkpoint after step 5."""
    ckpt_dir = tmp_path_factory.mktemp("policy_ckpt") / "step_5" / "policy"
    group = PolicyWorkerGroup(policy_cfg, cluster_cfg, seed=0, name="test-straight")
    try:
        group.setup_loaders(factories(WORLD))
        group.prepare_for_training()
        steps, loader_states = [], None
        for step in range(1, STEPS + 1):
            steps.append(one_step(group))
            if step == SAVE_AT:
                group.save_checkpoint(
                    str(ckpt_dir / "weights"), str(ckpt_dir / "optimizer"), None, False
                )
                loader_states = worker_probes.loader_states(group)
        yield {
            "group": group,
            "steps": steps,
            "ckpt": ckpt_dir,
            "loader_states": loader_states,
            "weights": worker_probes.weights(group),
            "optimizer": worker_probes.optimizer_state(group),
        }
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def resumed(straight, policy_cfg, cluster_cfg):
    """Fresh actors that load the step-5 checkpoint and train steps 6-10."""
    ckpt_dir = straight["ckpt"]
    group = PolicyWorkerGroup(
        policy_cfg,
        cluster_cfg,
        seed=123,  # a different seed: everything must come from the checkpoint
        name="test-resumed",
        restore={
            "weights_path": str(ckpt_dir / "weights"),
            "optimizer_path": str(ckpt_dir / "optimizer"),
        },
    )
    try:
        group.setup_loaders(factories(WORLD), straight["loader_states"])
        steps = [one_step(group) for _ in range(STEPS - SAVE_AT)]
        yield {"group": group, "steps": steps, "weights": worker_probes.weights(group)}
    finally:
        group.shutdown()


def test_dp_training_equals_single_process(straight, policy_cfg):
    ref_losses, ref_weights = reference_losses(policy_cfg, STEPS, WORLD)
    losses = [s[0].loss for s in straight["steps"]]
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(straight["weights"][0][name], ref, rtol=1e-5, atol=1e-6)
    first = straight["steps"][0][0]
    assert first.valid_tokens == sum(s.local_valid_tokens for s in straight["steps"][0])
    assert len(first.micro_batches) == sources.ROWS_PER_RANK // policy_cfg.train_micro_batch_size
    assert {"forward_backward_s", "allreduce_s", "optimizer_s", "grad_norm", "lr"} <= set(
        asdict(first)
    )


def test_replicas_stay_bitwise_identical(straight):
    for rank_steps in straight["steps"]:
        assert rank_steps[0].loss == rank_steps[1].loss
        assert rank_steps[0].grad_norm == rank_steps[1].grad_norm
    w0, w1 = straight["weights"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    o0, o1 = straight["optimizer"]
    for pid, s0 in o0["optimizer"]["state"].items():
        assert all(torch.equal(s0[k], o1["optimizer"]["state"][pid][k]) for k in s0)


def test_checkpoint_files_load_with_weights_only(straight):
    ckpt_dir = straight["ckpt"]
    state = torch.load(ckpt_dir / "optimizer" / "optimizer.pt", weights_only=True)
    assert state["scheduler"]["steps_done"] == SAVE_AT
    assert (ckpt_dir / "weights" / "model.safetensors").exists()
    for rank in range(WORLD):
        rng = torch.load(ckpt_dir / "rng" / f"rank_{rank}.pt", weights_only=True)
        assert rng["num_threads"] == 1
    assert not list(ckpt_dir.rglob("*.tmp.*"))


def test_resume_from_step_5_is_bitwise_exact(straight, resumed):
    want = [s[0].loss for s in straight["steps"][SAVE_AT:]]
    got = [s[0].loss for s in resumed["steps"]]
    assert got == want  # exact float equality, every step
    for rank in range(WORLD):
        w_straight, w_resumed = straight["weights"][rank], resumed["weights"][rank]
        assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight)


def test_abort_leaves_weights_and_optimizer_bitwise_unchanged(straight):
    group = straight["group"]
    before_w, before_o = worker_probes.weights(group), worker_probes.optimizer_state(group)
    envelopes = [o.envelope for o in start_step(group)]
    group.abort_train_step()
    group.abort_batches()
    after_w, after_o = worker_probes.weights(group), worker_probes.optimizer_state(group)
    for b, a in zip(before_w + before_o, after_w + after_o, strict=True):
        assert_tree_equal(b, a)
    # the aborted batch is delivered again and trains normally
    assert start_step(group)[0].envelope.source_ids == envelopes[0].source_ids
    results = group.wait(group.send_finish())
    group.commit_batches()
    assert results[0].step == STEPS + 1


def test_start_and_finish_calls_fail_together_and_chain_without_waiting(straight):
    """The controller's calls: `start_sft_step` (commit previous, load, begin, train) and
    `finish_train_step`, with the next start queued behind a finish.

    A rank whose forward pass raises fails its start in "train" and the queued finish refuses
    on every rank (no process-group timeout); weights stay bitwise unchanged. A start whose
    previous step did not finish commits nothing.
    """
    group = straight["group"]
    before_w = worker_probes.weights(group)
    started = group.send_start(sources.LossFailingOnRank(1), False)
    finish = group.send_finish()
    with pytest.raises(PolicyWorkerError, match="loss blew up on rank 1") as info:
        group.wait(started)
    assert info.value.phase == "train" and info.value.ranks == [1]
    with pytest.raises(PolicyWorkerError, match="no trained step|before a successful"):
        group.wait(finish)  # refused, not a process-group timeout
    # the failed step is still open: a start asked to commit its batch refuses, on every rank
    with pytest.raises(PolicyWorkerError, match="did not finish") as info:
        group.wait(group.send_start(NLLLossFn(), True))
    assert info.value.phase == "loading" and sorted(info.value.ranks) == [0, 1]
    group.abort_train_step()
    group.abort_batches()
    for b, a in zip(before_w, worker_probes.weights(group), strict=True):
        assert_tree_equal(b, a)
    # step, then the next start queued behind its finish (committing its batch): one wait
    envelopes = [o.envelope for o in start_step(group)]
    group.abort_train_step()
    group.abort_batches()
    refs = group.send_start(NLLLossFn(), False)
    refs += group.send_finish()
    refs += group.send_start(NLLLossFn(), True)
    refs += group.send_finish()
    first, done1, second, done2 = (
        group.wait(refs)[i : i + WORLD] for i in range(0, 4 * WORLD, WORLD)
    )
    assert [o.envelope.source_ids for o in first] == [e.source_ids for e in envelopes]
    assert second[0].envelope.source_ids != first[0].envelope.source_ids
    assert done2[0].step == done1[0].step + 1
    group.commit_batches()


def test_a_background_checkpoint_holds_its_step_while_the_next_step_trains(straight, tmp_path):
    """`checkpointing.background_writes`: the workers copy what the files hold and write them
    from a thread while the step queued behind the save trains; the files are exactly the
    synchronous save's, though the weights and AdamW state moved on before they were written."""
    group = straight["group"]
    sync, background = tmp_path / "sync", tmp_path / "background"
    group.save_checkpoint(str(sync / "weights"), str(sync / "optimizer"), None, False)
    written = group.send_save(
        str(background / "weights"),
        str(background / "optimizer"),
        final=False,
        rng_path=str(background / "rng"),
        background=True,
    )
    moved_on = one_step(group)  # queued behind begin_checkpoint, not behind the writes
    results = group.wait(written)
    assert [r.step for r in results] == [moved_on[0].step - 1] * WORLD
    files = sorted(Path(f).relative_to(background) for r in results for f in r.files)
    assert files == sorted(p.relative_to(sync) for p in sync.rglob("*") if p.is_file())
    for name in files:
        a, b = sync / name, background / name
        if name.suffix == ".safetensors":
            assert_tree_equal(load_file(a), load_file(b))
        else:
            assert_tree_equal(torch.load(a, weights_only=False), torch.load(b, weights_only=False))
    now = worker_probes.weights(group)[0]
    saved = load_file(background / "weights" / "model.safetensors")
    assert any(not torch.equal(now[k], saved[k]) for k in saved)  # the step did move them


def test_a_failed_background_checkpoint_is_reported_by_the_wait(straight, tmp_path):
    group = straight["group"]
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the weights folder should go")
    written = group.send_save(
        str(blocker / "weights"), None, final=False, rng_path=str(tmp_path / "rng"), background=True
    )
    with pytest.raises(PolicyWorkerError, match="Not a directory|not a directory"):
        group.wait(written)
    one_step(group)  # the group trains on


def test_the_workers_start_with_a_heap_that_keeps_freed_memory(straight):
    # runtime/process/heap.py: glibc reads these once, at the process's start
    want = worker_heap_env()
    assert want, "this test runs on Linux with glibc"
    for env in worker_probes.heap_env(straight["group"]):
        assert {k: env.get(k) for k in want} == want


def test_restore_refuses_another_thread_count_and_cleans_up(straight, policy_cfg, cluster_cfg):
    ckpt_dir = straight["ckpt"]
    cluster = cluster_cfg.model_copy(update={"num_threads_per_worker": 2})
    before = _live_placement_groups()
    with pytest.raises(UserInputError, match="num_threads_per_worker=1"):
        PolicyWorkerGroup(
            policy_cfg,
            cluster,
            name="test-threads",
            restore={"weights_path": str(ckpt_dir / "weights")},
        )
    assert _live_placement_groups() == before


def test_unplaceable_group_fails_naming_the_resources(ray_session, policy_cfg, cluster_cfg):
    cluster = cluster_cfg.model_copy(update={"cpus_per_worker": 64.0, "placement_timeout_s": 1})
    before = _live_placement_groups()
    with pytest.raises(PlacementError, match=r"CPU: need 128.*cluster\.cpus_per_worker"):
        PolicyWorkerGroup(policy_cfg, cluster, name="test-unplaceable")
    assert _live_placement_groups() == before


def test_dead_worker_fails_the_step_and_shutdown_cleans_up(resumed):
    group = resumed["group"]
    start_step(group)
    # rank 0 enters the gradient all-reduce, then its peer dies mid-step
    pending = group.send_finish(ranks=[0])
    ray.kill(group.workers[1], no_restart=True)
    with pytest.raises(PolicyWorkerError) as info:
        group.wait(pending)
    assert info.value.ranks == [0]
    with pytest.raises(PolicyWorkerError, match="rank 1: worker died") as info:
        group.abort_train_step()
    assert 1 in info.value.ranks
    actor_ids = [w._actor_id.hex() for w in group.workers]
    pg_id = group.placement_group.id.hex()
    survivor = ray.get(group.workers[0].__ray_call__.remote(lambda _self: os.getpid()))
    group.shutdown()
    # gone when shutdown returns: a driver that exits next must not find it standing (its
    # Ray would SIGTERM it, and the worker would print a traceback under a good run)
    assert not _process_alive(survivor)
    group.shutdown()  # idempotent
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    assert _eventually(lambda: all(_actor_state(a) == "DEAD" for a in actor_ids))
    with pytest.raises(PolicyWorkerError, match="shut down"):
        group.ping()


def _live_placement_groups() -> set[str]:
    return {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _actor_state(actor_id: str) -> str:
    return ray._private.state.actors().get(actor_id, {}).get("State", "UNKNOWN")


def _eventually(check, bound_s: float = 120.0) -> bool:
    """Poll a condition that Ray settles asynchronously (bounded, not a timing assertion:
    the bound is far beyond what a busy machine takes)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()

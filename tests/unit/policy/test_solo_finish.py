"""A replica with no peers (one process, no process group: the real-model benchmark's worker,
a DP=1 run) steps on the gradients its backward passes left, with no flat copy of them to
all-reduce, and lands bit for bit where the flat buffer's path lands."""

from __future__ import annotations

import types

import torch

from sft_runtime.runtime.policy import replica as replica_module
from sft_runtime.runtime.policy.config import ModelConfig, PolicyConfig
from sft_runtime.runtime.policy.replica import Replica
from tests.support import sources

STEPS = 3


def _policy() -> PolicyConfig:
    return PolicyConfig(
        precision="float32",
        dtensor_cfg={"enabled": False},
        model=ModelConfig(
            vocab_size=sources.VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=sources.SEQ_LEN
        ),
        train_global_batch_size=sources.ROWS_PER_RANK,
        train_micro_batch_size=2,
        max_grad_norm=1.0,
        optimizer={"kwargs": {"lr": 3e-3, "weight_decay": 0.01}},
    )


def _train(grads_seen: list[bool]):
    """STEPS steps of one replica: (each step's loss and grad norm, the weights after)."""
    replica = Replica(_policy(), seed=0, device=torch.device("cpu"))
    step = replica.optimizer.step
    backward_grads: dict[int, torch.Tensor] = {}

    def checked(*args, **kwargs):
        grads_seen.append(all(p.grad is backward_grads[id(p)] for p in replica.params))
        return step(*args, **kwargs)

    replica.optimizer.step = checked
    out = []
    for i in range(STEPS):
        batch = sources.make_batch(
            sources.SEED,
            0,
            i,
            rows=sources.ROWS_PER_RANK,
            seq_len=sources.SEQ_LEN,
            vocab_size=sources.VOCAB,
        )
        replica.begin(None, lambda batch=batch: batch)
        replica.train(batch)
        backward_grads.clear()
        backward_grads.update({id(p): p.grad for p in replica.params})
        finished = replica.finish()
        out.append((finished.loss, finished.grad_norm))
    return out, replica.files.weights()


def _world_of_two_that_adds_nothing() -> types.SimpleNamespace:
    """torch.distributed as a rank with peers sees it, whose all-reduce leaves the buffer as
    it is (what peers holding zeros would add): the replica takes the flat buffer's path."""

    def all_reduce(tensor, op=None, async_op=False):
        return types.SimpleNamespace(wait=lambda: None)

    return types.SimpleNamespace(
        is_initialized=lambda: True,
        get_world_size=lambda: 2,
        all_reduce=all_reduce,
        ReduceOp=types.SimpleNamespace(SUM="sum", MIN="min"),
    )


def test_a_replica_without_peers_keeps_its_gradients_and_the_flat_paths_numbers(monkeypatch):
    assert not torch.distributed.is_initialized()
    solo_seen: list[bool] = []
    solo, solo_weights = _train(solo_seen)
    assert solo_seen == [True] * STEPS  # the optimizer stepped on the backward's own tensors

    monkeypatch.setattr(replica_module, "dist", _world_of_two_that_adds_nothing())
    flat_seen: list[bool] = []
    flat, flat_weights = _train(flat_seen)
    assert flat_seen == [False] * STEPS  # there, the gradients are views of the reduced buffer

    assert solo == flat
    assert solo_weights.keys() == flat_weights.keys()
    assert all(torch.equal(solo_weights[k], flat_weights[k]) for k in solo_weights)

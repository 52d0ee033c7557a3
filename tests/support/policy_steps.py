"""The policy-group tests' shared pieces: synthetic loaders, one controller-style step, and
the single-process ground truth both the data-parallel and the FSDP2 groups are held to."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from sft_runtime.runtime.policy.loss import NLLLossFn
from sft_runtime.runtime.policy.model import TinyTransformer
from sft_runtime.runtime.policy.step_outcome import StepFinished
from sft_runtime.runtime.workers.results import StepStarted, StepTrained
from tests.support import sources


def factories(world: int) -> list:
    return [
        functools.partial(
            sources.SyntheticSource,
            sources.SEED,
            rank,
            world,
            rows=sources.ROWS_PER_RANK,
            seq_len=sources.SEQ_LEN,
            vocab_size=sources.VOCAB,
        )
        for rank in range(world)
    ]


def one_step(group: Any) -> list[StepFinished]:
    """One step through the runtime's call (one `train_sft_step` per worker, as the
    controller sends it), then the batch's commit; each rank's finish."""
    trained: list[StepTrained] = group.wait(group.send_step(NLLLossFn(), False))
    group.commit_batches()
    return [t.finished for t in trained]


def start_step(group: Any, loss_fn: Any = None) -> list[StepStarted]:
    """A step up to its gradients, left open (finish it, or abort it and its batch)."""
    return group.wait(group.send_start(loss_fn or NLLLossFn(), False))


def _named(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def nemo_rl_optimizer(params: Any, policy: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and a live LR scheduler built from the config as NeMo RL's worker
    builds them, stepped after each optimizer step (a constant rate without a scheduler):
    the runtime, which recomputes each rate from the step count, is held to this."""
    opt = _named(policy.optimizer.name)(params, **policy.optimizer.kwargs)
    spec = policy.scheduler
    if spec is None:
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    if isinstance(spec, dict):
        return opt, _named(spec["name"])(opt, **spec.get("kwargs", {}))
    chain = [_named(e["name"])(opt, **e.get("kwargs", {})) for e in spec if "name" in e]
    milestones = [e["milestones"] for e in spec if "milestones" in e]
    if not milestones:
        return opt, chain[0]
    return opt, torch.optim.lr_scheduler.SequentialLR(opt, chain, milestones[0])


def reference_losses(policy, steps: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A single process trained on the stacked global batches (the ground truth)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyTransformer(policy.model)
    opt, schedule = nemo_rl_optimizer(model.parameters(), policy)
    fn, losses = NLLLossFn(), []
    for i in range(steps):
        batch = sources.global_batch(
            sources.SEED,
            world,
            i,
            rows=sources.ROWS_PER_RANK,
            seq_len=sources.SEQ_LEN,
            vocab_size=sources.VOCAB,
        )
        total_tokens, total = fn.valid_tokens(batch), 0.0
        opt.zero_grad()
        for s in range(0, batch.num_rows, policy.train_micro_batch_size):
            mb = batch.rows(s, s + policy.train_micro_batch_size)
            loss, _ = fn(model(mb.input_ids, mb.position_ids, mb.segment_ids), mb, total_tokens)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), policy.max_grad_norm)
        opt.step()
        schedule.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_tree_equal(a: Any, b: Any) -> None:
    """Nested dicts, lists and tensors equal bit for bit (optimizer states, weights)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_tree_equal(x, y)
    else:
        assert a == b

"""`evaluate`: the summed NLL of batches under the replica's current weights, and nothing else.

A validation pass between steps must leave training exactly as it was: no gradient, no
optimizer state, no random number drawn (a run that validates trains bit for bit like one
that does not). So the forward passes run without autograd, in eval mode (dropout off), under
the training precision, and every RNG the worker seeds is put back afterwards. The loss is the
training loss's own NLL over the same loss mask (`NLLLossFn`), summed, so the controller can
weight ranks by their tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from sft_runtime.runtime.data.batch import SFTBatch
from sft_runtime.runtime.policy.loss import NLLLossFn
from sft_runtime.runtime.policy.model import forward_logits
from sft_runtime.runtime.policy.replica import Replica


@contextmanager
def rng_untouched(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's generators as they were when the block began."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


@torch.no_grad()
def evaluate(
    replica: Replica, batches: list[SFTBatch], error: Exception | None = None
) -> tuple[float, int]:
    """(summed NLL, supervised tokens) over ``batches``. Sharded, the ranks first agree that
    all can run (``error``: this rank's failure, raised after that), since every forward is a
    collective and every rank runs the same number of them."""
    if replica.sharded:
        replica.agree(error is not None, "validation")
    if error is not None:
        raise error
    loss_fn, model = NLLLossFn(), replica.model
    was_training = model.training
    model.eval()
    sums = []
    try:
        for batch in batches:
            mb = batch.to(replica.device)
            with replica.autocast():
                logits = forward_logits(model, mb)
            _, metrics = loss_fn(logits, mb, 1)
            sums.append(
                torch.stack([metrics["nll_sum"].double(), metrics["valid_tokens"].double()])
            )
    finally:
        model.train(was_training)
    nll, tokens = torch.stack(sums).sum(0).tolist() if sums else (0.0, 0.0)
    return float(nll), int(tokens)

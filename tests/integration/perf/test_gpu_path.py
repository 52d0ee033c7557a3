"""One bf16 training step on CUDA from a read-ahead batch (skipped without a GPU)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from sft_runtime.runtime.data.loader import ColocatedLoader
from sft_runtime.runtime.data.prefetch import PrefetchingLoader
from sft_runtime.runtime.policy.config import ModelConfig, PolicyConfig
from sft_runtime.runtime.policy.replica import Replica

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bf16_step_on_cuda_from_a_prefetched_batch(perf_spec):
    policy = PolicyConfig(
        dtensor_cfg={"enabled": False},
        model=ModelConfig(vocab_size=264, d_model=64, n_layers=2, n_heads=4, max_seq_len=96),
        train_global_batch_size=4,
        train_micro_batch_size=2,
        make_sequence_length_divisible_by=8,
        precision="bfloat16",
    )
    replica = Replica(policy, seed=0, device=torch.device("cuda", 0))
    loader = PrefetchingLoader(partial(ColocatedLoader, perf_spec(), 0, 1, "p"), 2)
    loader.setup()
    try:
        loader.load()
        replica.begin(None, lambda: loader.active_batch)
        replica.train(loader.active_batch)
        out = replica.finish()
        loader.commit()
    finally:
        loader.close()
    assert next(replica.model.parameters()).is_cuda
    assert math.isfinite(out.loss) and out.step == 1
    with replica.autocast():
        ids = torch.ones(1, 8, dtype=torch.long, device="cuda")
        logits = replica.model(ids, torch.arange(8, device="cuda")[None], torch.zeros_like(ids))
    assert logits.dtype == torch.bfloat16

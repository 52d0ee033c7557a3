"""One replica's LoRA training in plain torch (the code every worker runs, without Ray): a
bfloat16 frozen base that stays bitwise the folder's, float32 adapters that train, AdamW
state for the adapters alone."""

from __future__ import annotations

import pytest
import torch

from sft_runtime.runtime.checkpoint.weight_reader import read_all
from sft_runtime.runtime.lora.adapters import base_name, is_adapter
from sft_runtime.runtime.lora.base import weights_digest
from sft_runtime.runtime.policy.config import PolicyConfig
from sft_runtime.runtime.policy.loss import NLLLossFn
from sft_runtime.runtime.policy.replica import Replica
from tests.support import sources


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_training_moves_the_adapters_and_leaves_the_base_bitwise_as_stored(precision, tiny_llama):
    digest = weights_digest(tiny_llama)
    policy = PolicyConfig.model_validate(
        {
            "model_name": str(tiny_llama),
            "precision": precision,
            "dtensor_cfg": {
                "enabled": False,
                "lora_cfg": {"enabled": True, "dim": 4, "lora_A_init": "uniform"},
            },
            "train_global_batch_size": 4,
            "train_micro_batch_size": 2,
        }
    )
    replica = Replica(policy, seed=3, device=torch.device("cpu"))
    base_dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    frozen = {n: p for n, p in replica.model.named_parameters() if not p.requires_grad}
    trains = {n: p for n, p in replica.model.named_parameters() if p.requires_grad}
    assert frozen and all(p.dtype == base_dtype for p in frozen.values())
    assert set(trains) == {n for n in trains if is_adapter(n)} and trains
    assert all(p.dtype == torch.float32 for p in trains.values())
    before = replica.files.weights()
    vocab = replica.model.config.vocab_size
    for index in range(3):
        batch = sources.make_batch(0, 0, index, rows=4, seq_len=32, vocab_size=vocab)
        replica.begin(NLLLossFn(), lambda batch=batch: batch)
        replica.train(batch)
        replica.finish()
    after = replica.files.weights(include_frozen=True)
    stored = read_all(str(tiny_llama))
    for name in frozen:
        assert torch.equal(after[name], stored[base_name(name)].to(base_dtype)), name
    assert all(not torch.equal(after[n], before[n]) for n in before if "lora_B" in n)
    assert len(replica.optimizer.state) == len(trains)  # moments for the adapters only
    assert sorted(replica.files.weights()) == sorted(trains)  # what a checkpoint holds
    assert weights_digest(tiny_llama) == digest

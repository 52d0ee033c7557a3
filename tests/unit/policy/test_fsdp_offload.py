"""``policy.dtensor_cfg.cpu_offload``: FSDP2's `CPUOffloadPolicy` on a replica, in one process
with a gloo group of 1 (CPU).

A pretrained model started from its meta-device skeleton is filled in host memory, every
FSDP unit carries the offload policy (FSDP2's own record, read back through
`local_storage`), its shards equal the whole load, and a training step through the replica's
own phases gives the same loss, gradient norm and weights as the same replica without the
offload, bit for bit (on a CPU device nothing moves). Buffers moved back to the device
after an offloaded fill keep a buffer shared by two modules one tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sft_runtime.runtime.data.batch import SFTBatch
from sft_runtime.runtime.policy import fsdp, rendezvous
from sft_runtime.runtime.policy.config import PolicyConfig
from sft_runtime.runtime.policy.hf_model import load_hf_model
from sft_runtime.runtime.policy.replica import Replica
from tests.support import sources
from tests.support.hf_models import build_model

VOCAB = 97
ROWS, WIDTH = 4, 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("offload-llama")
    build_model(out, family="llama", vocab_size=VOCAB, max_positions=64)
    return out


@pytest.fixture
def gloo_of_one():
    store = rendezvous.serve(timeout_s=60)
    rendezvous.join("gloo", 0, 1, port=store.port, store=store, timeout_s=60)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _policy(folder: Path, cpu_offload: bool) -> PolicyConfig:
    return PolicyConfig(
        model_name=str(folder),
        precision="float32",  # pinned: the defaults move to NeMo RL's (bfloat16)
        dtensor_cfg={"enabled": True, "cpu_offload": cpu_offload},
        train_global_batch_size=ROWS,
        train_micro_batch_size=2,
        optimizer={"kwargs": {"lr": 1e-3}},
    )


def _batch() -> SFTBatch:  # rows of varied length, some packing two samples
    return sources.make_batch(3, 0, 0, rows=ROWS, seq_len=WIDTH, vocab_size=VOCAB)


def _one_step(folder: Path, cpu_offload: bool) -> dict:
    replica = Replica(_policy(folder, cpu_offload), seed=0, device=torch.device("cpu"))
    replica.shard(1)
    storage = replica.files.local_storage()
    start = replica.files.weights()
    replica.begin(None, _batch)
    replica.train()
    finished = replica.finish()
    return {
        "storage": storage,
        "start": start,
        "finished": finished,
        "end": replica.files.weights(),
    }


def test_an_offloaded_replica_fills_in_host_memory_and_trains_as_without(folder, gloo_of_one):
    offloaded = _one_step(folder, cpu_offload=True)
    storage = offloaded["storage"]
    assert storage["params_offloaded_local"] == storage["params_local"] > 10_000
    assert storage["start_read_local"] == storage["start_read_full"]  # world 1: all of it
    whole = load_hf_model(str(folder)).state_dict()
    assert all(torch.equal(offloaded["start"][k], whole[k]) for k in offloaded["start"])

    plain = _one_step(folder, cpu_offload=False)
    assert plain["storage"]["params_offloaded_local"] == 0
    got, want = offloaded["finished"], plain["finished"]
    assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
    assert 0 < got.grad_norm and got.loss > 0
    assert sorted(offloaded["end"]) == sorted(plain["end"])
    assert all(torch.equal(offloaded["end"][k], plain["end"][k]) for k in plain["end"])
    assert not all(torch.equal(offloaded["end"][k], whole[k]) for k in whole)  # it trained


def test_the_shard_model_offload_policy_pins_memory_only_for_a_gpu(gloo_of_one):
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from sft_runtime.runtime.policy.config import DTensorConfig, ModelConfig
    from sft_runtime.runtime.policy.model import TinyTransformer

    model = TinyTransformer(ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2))
    parallel = DTensorConfig(enabled=True, cpu_offload=True)
    fsdp.shard_model(model, parallel, fsdp.build_mesh(parallel, 1, torch.device("cpu")))
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 3  # two layers and the root
    for unit in units:
        policy = unit._get_fsdp_state()._fsdp_param_group.offload_policy
        assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    assert fsdp.offloaded_elements(model) == sum(p.numel() for p in model.parameters())


def test_buffers_move_to_the_device_and_a_shared_buffer_stays_one_tensor():
    shared = torch.arange(4.0)
    model = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
    model[0].register_buffer("freq", shared)
    model[1].register_buffer("freq", shared)
    model[1].register_buffer("own", torch.ones(2), persistent=False)
    fsdp.buffers_to(model, torch.device("meta"))  # any device other than the buffers'
    assert model[0].freq.is_meta and model[1].own.is_meta
    assert model[0].freq is model[1].freq

"""A sharded start reads only each rank's slices, and they are today's whole load, bit for bit.

Two ranks (gloo, CPU) each build the skeleton, shard it with FSDP2 and fill it from the folder;
every local shard must equal the same rows of `load_hf_model`'s tensors, every buffer (rotary
``inv_freq``) must equal the whole load's, tied weights must stay one parameter, and each rank
must have read its share only. A sharded checkpoint saved from there and resumed into a fresh
sharded start never makes a tensor larger than the rank's largest shard (optimizer included).
Folders: one file, many files under an index (stored in bf16, as on the hub), and a model
whose LM head is tied to its embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy import rendezvous
from sft_runtime.runtime.policy.config import DTensorConfig
from sft_runtime.runtime.policy.hf_model import load_hf_model
from sft_runtime.runtime.policy.hf_shards import can_slice, fill_from_folder, skeleton
from tests.support.hf_models import build_model, tiny_model
from tests.support.memory import LargestTensor

WORLD = 2
VOCAB = 97  # odd: the last rank's shard of the embedding is a row shorter


def _tied(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model(
        LlamaConfig,
        LlamaForCausalLM,
        seed=1,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model.save_pretrained(str(out))


@pytest.fixture(scope="module", params=["one-file", "indexed-bf16", "tied"])
def folder(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "tied":
        _tied(out)
    elif request.param == "one-file":
        build_model(out, family="llama", vocab_size=VOCAB, max_positions=64)
    else:
        model = build_model(
            out, family="qwen2", vocab_size=VOCAB, max_positions=64, dtype=torch.bfloat16
        )
        for f in out.glob("model*.safetensors*"):
            f.unlink()
        model.save_pretrained(str(out), max_shard_size="40KB")
        assert len(list(out.glob("model-*.safetensors"))) > 2
    return out


def _rank(rank: int, port: int, folder: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from sft_runtime.runtime.policy import fsdp

    rendezvous.join("gloo", rank, WORLD, port=port)
    try:
        whole = load_hf_model(folder)
        expected = whole.state_dict()
        model = skeleton(folder)
        assert all(p.is_meta for p in model.parameters())
        parallel = DTensorConfig(enabled=True)
        fsdp.shard_model(model, parallel, fsdp.build_mesh(parallel, WORLD, torch.device("cpu")))
        read = fill_from_folder(model, folder, torch.device("cpu"))
        report = {"read": read, "mismatch": [], "shards": {}}
        for name, param in model.named_parameters():
            local = param.to_local()
            rows = local.shape[0]
            start = param.device_mesh.get_local_rank() * -(-param.shape[0] // WORLD)
            want = expected[name][start : start + rows]
            if not isinstance(param, DTensor) or not torch.equal(local, want):
                report["mismatch"].append(name)
            report["shards"][name] = [start, rows]
        for name, buf in model.named_buffers():
            if not torch.equal(buf, whole.get_buffer(name)):
                report["mismatch"].append(name)
        tied = whole.config.tie_word_embeddings
        report["tied_one_param"] = model.lm_head.weight is model.model.embed_tokens.weight
        report["tied"] = tied
        # the model still trains: a forward and backward through the filled shards
        ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
        report["grads"] = all(p.grad is not None for p in model.parameters())
        report["resume"] = _save_and_resume(model, folder, parallel, Path(out) / "ckpt")
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _save_and_resume(model, folder: str, parallel: DTensorConfig, ckpt: Path) -> dict:
    """A sharded checkpoint (weights and AdamW moments) saved and read into a fresh sharded
    start: the largest tensor any op makes on the way, against this rank's largest shard,
    and whether the resumed shards equal the saved ones."""
    from sft_runtime.runtime.checkpoint.sharded import load_shards, save_shards
    from sft_runtime.runtime.policy import fsdp

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    shard = max(p.to_local().numel() for p in model.parameters())
    with LargestTensor(floating_only=True) as saving:
        save_shards(str(ckpt), fsdp.sharded_state(model, optimizer))
    fresh = skeleton(folder)
    fsdp.shard_model(fresh, parallel, fsdp.build_mesh(parallel, WORLD, torch.device("cpu")))
    with LargestTensor(floating_only=True) as starting:
        fill_from_folder(fresh, folder, torch.device("cpu"))
        resumed = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        state = fsdp.sharded_state(fresh, resumed)
        load_shards(str(ckpt), state)
        fsdp.load_sharded_state(fresh, resumed, state)
    saved = dict(model.named_parameters())
    moments = [
        torch.equal(
            resumed.state[p]["exp_avg"].to_local(), optimizer.state[saved[n]]["exp_avg"].to_local()
        )
        for n, p in fresh.named_parameters()
    ]
    return {
        "largest_shard": shard,
        "largest_saving": saving.largest,
        "largest_starting": starting.largest,
        "weights_equal": all(
            torch.equal(p.to_local(), saved[n].to_local()) for n, p in fresh.named_parameters()
        ),
        "moments_equal": all(moments),
    }


def test_each_rank_reads_only_its_slices_and_they_equal_the_whole_load(folder, tmp_path):
    assert can_slice(str(folder))
    store = rendezvous.serve()  # held until both ranks are done
    mp.spawn(_rank, args=(store.port, str(folder), str(tmp_path)), nprocs=WORLD, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    whole = sum(p.numel() for p in load_hf_model(str(folder)).parameters())
    for report in reports:
        assert report["mismatch"] == []
        assert report["grads"]
        assert report["tied_one_param"] == report["tied"]
        assert report["read"]["elements_whole"] == whole
        assert report["read"]["elements_read"] <= -(-whole // WORLD) + VOCAB * 64
        resume = report["resume"]  # nothing on the way to a resumed step holds a whole tensor
        assert resume["weights_equal"] and resume["moments_equal"]
        assert resume["largest_saving"] <= resume["largest_shard"]
        assert resume["largest_starting"] <= resume["largest_shard"]
    assert sum(r["read"]["elements_read"] for r in reports) == whole  # each row read once
    for name, (start, _rows) in reports[1]["shards"].items():
        assert reports[0]["shards"][name] == [0, start], name  # the two shards meet


def test_a_folder_that_does_not_cover_the_model_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    build_model(tmp_path, family="llama", vocab_size=VOCAB, max_positions=64)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = skeleton(str(tmp_path))
    with pytest.raises(UserInputError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        fill_from_folder(model, str(tmp_path), torch.device("cpu"))


def test_a_pickled_checkpoint_cannot_be_sliced(tmp_path):
    from safetensors.torch import load_file

    build_model(tmp_path, family="llama", vocab_size=VOCAB, max_positions=64)
    assert can_slice(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    torch.save(tensors, tmp_path / "pytorch_model.bin")  # an older checkpoint: a pickle
    (tmp_path / "model.safetensors").unlink()
    assert not can_slice(str(tmp_path))

"""Throughput of sft-runtime on a Llama-architecture model of about 1B parameters, sharded with
FSDP2 in bf16, against a plain torch FSDP2 loop over the same model and the same batches.

The model is built from its config (random weights, nothing downloaded) and saved once as a
model folder with a BPE tokenizer trained offline; the data is the demo chat set, packed into
rows of ``--seq`` tokens. sft-runtime trains it with ``policy.dtensor_cfg.enabled`` (param bf16,
reduce fp32, activation checkpointing) over ``--gpus`` workers; the plain loop is one process
per GPU (NCCL) with the same `fully_shard` layout, packed-row attention (`hf_logits`), AdamW
and micro-batching, fed the very batches the runtime's loaders yield (written beforehand,
so it does no loading).

Printed per side: tokens/s (every token of a row, padding included, as MFU counts them), MFU
(model FLOPs including attention over the device's peak bf16 FLOPs), peak GPU memory, and the
ratio sft-runtime / plain. Targets: ratio >= 0.97, MFU >= 35% on an H100/H200-class GPU.
``--smoke`` runs the same code on CPU (gloo) with a tiny model on one rank: it proves the script,
not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(ROOT))

from bench.harness import SMOKE_THREADS_ENV, WARMUP, committed, master_config  # noqa: E402

LLAMA_1B = {  # Llama-3.2-1B's shape with a 32k vocabulary: 1.1B parameters
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, no sparsity
TARGET_RATIO, TARGET_MFU = 0.97, 0.35


def model_dir(out: Path, shape: dict, vocab: int, seq: int) -> Path:
    """A model folder: tokenizer trained offline, a Llama of ``shape`` with random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.hf_models import hf_model_dir

    folder = hf_model_dir(out, family="llama")  # the tokenizer and its chat template
    config = LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        bos_token_id=LlamaConfig.from_pretrained(folder).bos_token_id,
        eos_token_id=LlamaConfig.from_pretrained(folder).eos_token_id,
        **shape,
    )
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def raw_config(args, folder: Path, data: Path, run_dir: Path) -> dict:
    gpus = 0 if args.smoke else args.gpus
    return {
        "policy": {
            "model_name": str(folder),
            "train_global_batch_size": args.gpus * args.micro * args.accum,
            "train_micro_batch_size": args.micro,
            "optimizer": {  # the plain loop's AdamW: torch's defaults
                "kwargs": {"lr": 1e-4, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}
            },
            "make_sequence_length_divisible_by": 64,
            "sequence_packing": {"enabled": True, "algorithm": "first_fit_decreasing"},
            "dtensor_cfg": {
                "enabled": True,
                "param_dtype": "bfloat16",
                "reduce_dtype": "float32",
                "activation_checkpointing": True,
            },
        },
        "data": {
            "max_input_seq_length": args.seq,
            "train": {"path": str(data), "virtual_epoch_length": 100_000},
            "num_workers": 0,
            "energon": {"shuffle_buffer_size": 64},
        },
        "sft": {"max_num_steps": args.steps, "max_num_epochs": 100, "seed": 1},
        "logger": {"log_dir": str(run_dir)},
        "cluster": {
            "workers_per_node": args.gpus,
            "gpus_per_node": gpus,
            "cpus_per_worker": 1,
            "num_threads_per_worker": 1 if args.smoke else 4,
            "call_timeout_s": 600,
        },
        "checkpointing": {"enabled": False},
        "data_plane": {"max_partitions": 2},
    }


def flops_per_token(config, seq: int) -> float:
    """Training FLOPs per token: 6 x parameters in matmuls, plus attention's score and value
    matmuls (12 x layers x hidden x seq, halved for the causal mask)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * config.intermediate_size
    params = layers * per_layer + config.vocab_size * h  # the LM head (embedding: a lookup)
    return 6 * params + 12 * layers * h * seq / 2


def runtime_side(args, raw: dict) -> dict:
    from sft_runtime.runtime.launch.driver import run_training

    run_training(master_config(raw))
    records = committed(Path(raw["logger"]["log_dir"]))
    window = [r.time for r in records][WARMUP - 1 :]
    step_s = (window[-1] - window[0]) / (len(window) - 1)
    # the workers' own peak is not reported back by a run; the plain loop's stands for both
    return {"step_s": step_s, "losses": [r.data["loss"] for r in records], "peak": None}


def plain_rank(rank: int, world: int, port: int, job: dict) -> None:
    """One rank of the plain FSDP2 loop: the same model, layout, optimizer and batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from sft_runtime.runtime.policy import rendezvous
    from sft_runtime.runtime.policy.fsdp import enable_activation_checkpointing
    from sft_runtime.runtime.policy.hf_model import hf_logits, load_hf_model

    cuda = not job["smoke"]
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    rendezvous.join(backend, rank, world, port=port)
    # the runtime's own packed-row attention: the two sides differ in the runtime, not the kernel
    model = load_hf_model(job["folder"]).to(device)
    enable_activation_checkpointing(model)  # as policy.dtensor_cfg.activation_checkpointing does
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = torch.load(job["batches"], weights_only=False)[rank]
    ends = []
    for batch in batches:
        batch = batch.to(device)
        tokens = torch.tensor([float((batch.loss_mask > 0).sum())], device=device)
        dist.all_reduce(tokens)
        for s in range(0, batch.num_rows, job["micro"]):
            mb = batch.rows(s, s + job["micro"])
            logits = hf_logits(model, mb.input_ids, mb.position_ids, mb.segment_ids)
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            nll = -logp.gather(-1, mb.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            (nll * mb.loss_mask[:, 1:]).sum().div(tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    if rank == 0:
        window = ends[WARMUP - 1 :]
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        out = {"step_s": (window[-1] - window[0]) / (len(window) - 1), "peak": peak}
        Path(job["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def plain_side(args, raw: dict, folder: Path, work: Path) -> dict:
    import torch.multiprocessing as mp

    from bench.plain_loop import pretokenize

    batches = pretokenize(raw, args.gpus, args.steps, work / "batches.pt")
    from sft_runtime.runtime.policy import rendezvous

    store = rendezvous.serve()  # held until every rank is done
    job = {
        "folder": str(folder),
        "batches": str(batches),
        "micro": args.micro,
        "smoke": args.smoke,
        "out": str(work / "plain.json"),
    }
    mp.spawn(plain_rank, args=(args.gpus, store.port, job), nprocs=args.gpus)
    return json.loads((work / "plain.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo)")
    args = parser.parse_args()
    if args.smoke:  # one torch thread in each process, ranks and Ray's workers (harness says why)
        os.environ.update(SMOKE_THREADS_ENV)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_hf: SKIP - no CUDA GPU visible to torch")
        return
    if args.gpus is None:
        # smoke: one rank a side; FSDP2 and the script's code are the same at any count, and
        # bench/load_memory.py trains a sharded run on two workers end to end
        args.gpus = 1 if args.smoke else torch.cuda.device_count()
    if args.smoke:  # the steps timed are those after WARMUP: two are enough to prove it
        args.seq = min(args.seq, 256)
        args.steps = min(args.steps, WARMUP + 2)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # the work folder goes at the end, a 1B model's weights and all (the GPU run)
    with tempfile.TemporaryDirectory(prefix="gpu-hf-") as tmp:
        measure(args, Path(tmp))


def measure(args: argparse.Namespace, work: Path) -> None:
    """Both sides on the same model, data and batches under ``work``; prints the figures."""
    import torch

    from sft_runtime.runtime.data.demo import build_demo_dataset

    shape = TINY if args.smoke else LLAMA_1B
    folder = model_dir(work / "model", shape, 32_000 if not args.smoke else 2_000, args.seq)
    data = build_demo_dataset(work / "data", num_samples=2_000, seed=0)
    raw = raw_config(args, folder, data, work / "run")
    plain = plain_side(args, raw, folder, work)
    ours = runtime_side(args, raw)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    tokens = args.gpus * args.micro * args.accum * args.seq  # per step, padding included
    device = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16.items() if k in device), None)
    print(
        f"gpu_hf: {device} x{args.gpus}, torch {torch.__version__}, seq {args.seq}, "
        f"{tokens} tokens/step, {flops_per_token(config, args.seq) / 6e9:.2f}B matmul params"
    )
    for name, side in (("plain FSDP2 loop", plain), ("sft-runtime", ours)):
        tps = tokens / side["step_s"]
        mfu = tps * flops_per_token(config, args.seq) / (peak * args.gpus) if peak else None
        side.update(tps=tps, mfu=mfu)
        mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        peak_text = "n/a" if side["peak"] is None else f"{side['peak'] / 2**30:.1f} GiB"
        print(
            f"  {name:18s} {side['step_s'] * 1e3:8.1f} ms/step  {tps:10.0f} tokens/s  "
            f"MFU {mfu_text}  peak {peak_text}"
        )
    ratio = ours["tps"] / plain["tps"]
    print(f"  ratio sft-runtime / plain: {ratio:.3f} (target >= {TARGET_RATIO})")
    if ours["mfu"] is not None:
        print(f"  MFU sft-runtime: {100 * ours['mfu']:.1f}% (target >= {100 * TARGET_MFU:.0f}%)")


if __name__ == "__main__":
    main()

"""LoRA against a full fine-tune of the same ~300M Llama on the same batches (DP=1, CPU).

Each mode trains in a child process of its own (smoke: both in one), through the code every
policy worker runs (`runtime.policy.replica.Replica`, without Ray, so nothing but the
training counts in its memory): the model read from a hub-like folder, ``STEPS`` optimizer
steps on the same synthetic batches, then the checkpoint files a worker writes (weights,
optimizer state, and for LoRA its ``lora.json``). Printed side by side: the median step
time, the child's peak RSS, the optimizer state's bytes, the checkpoint's bytes and the loss
after the last step. Targets: LoRA's optimizer state <= 5% of the full fine-tune's, its step
time <= the full fine-tune's; its checkpoint's share of a full checkpoint's bytes is printed
(< 5% asked).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench import zygote  # noqa: E402
from bench.table import Row  # noqa: E402

SHAPE = h.pick(  # ~294M parameters, untied head: as bench/load_memory.py
    {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 16},
    {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
)
HEADS = h.pick((16, 8), (4, 2))
VOCAB = h.pick(32_768, 1_024)
STEPS = h.pick(30, 3)
ROWS, SEQ = h.pick((2, 128), (2, 32))
LORA = {"enabled": True, "dim": 16, "alpha": 32, "match_all_linear": True}
LR = 2e-4
# torch threads of a mode's child: every core (smoke: one; `h.SMOKE_THREADS_ENV` says why)
THREADS = h.pick(max(1, os.cpu_count() or 1), 1)
# Full: each mode in a fresh process, so that its peak RSS is its own. Smoke: one process
# trains both modes in turn, each through its own `train_child` (smoke figures mean nothing).
ONE_CHILD = h.pick(False, True)
MARK = "lora-mode: "  # a child's result line
OPT_TARGET = 0.05
CKPT_TARGET = 0.05


def build_folder(out: Path) -> int:
    """A Llama saved as on the hub (float32 here: both modes read the same bytes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        num_attention_heads=HEADS[0],
        num_key_value_heads=HEADS[1],
        max_position_embeddings=max(SEQ, 256),
        tie_word_embeddings=False,
        **SHAPE,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(h.SEED)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def train_child(folder: str, mode: str, out: str) -> dict[str, Any]:
    """One mode's run in this process (the child): step times, losses, bytes, peak RSS."""
    import torch

    from sft_runtime.runtime.checkpoint import policy_files
    from sft_runtime.runtime.lora.base import base_record, weights_digest
    from sft_runtime.runtime.policy.config import PolicyConfig
    from sft_runtime.runtime.policy.loss import NLLLossFn
    from sft_runtime.runtime.policy.replica import Replica
    from tests.support import sources

    torch.set_num_threads(THREADS)
    policy = PolicyConfig.model_validate(
        {
            "model_name": folder,
            "train_global_batch_size": ROWS,
            "train_micro_batch_size": ROWS,
            "optimizer": {"kwargs": {"lr": LR}},
            # a whole replica in float32, as measured (NeMo RL's defaults: FSDP2, bfloat16)
            "precision": "float32",
            "dtensor_cfg": {"enabled": False, "lora_cfg": LORA if mode == "lora" else {}},
        }
    )
    replica = Replica(policy, seed=h.SEED, device=torch.device("cpu"))
    times, losses = [], []
    for index in range(STEPS):
        batch = sources.make_batch(h.SEED, 0, index, rows=ROWS, seq_len=SEQ, vocab_size=VOCAB)
        t0 = time.perf_counter()
        replica.begin(NLLLossFn(), lambda batch=batch: batch)
        replica.train(batch)
        result = replica.finish()
        times.append(time.perf_counter() - t0)
        losses.append(result.loss)
    moments = [
        v for s in replica.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    checkpoint = Path(out) / "policy"
    policy_files.save_weights(str(checkpoint / "weights"), replica.files.weights())
    policy_files.save_torch(
        str(checkpoint / "optimizer" / "optimizer.pt"),
        replica.files.optimizer_state(replica.steps_done),
    )
    if replica.lora_targets is not None:
        record = base_record(folder, weights_digest(folder), replica.lora_targets, LORA)
        (checkpoint / "weights" / "lora.json").write_bytes(record)
    return {
        "step_s": statistics.median(times[min(2, len(times) - 1) :]),
        "loss": losses[-1],
        "first_loss": losses[0],
        "optimizer_bytes": sum(v.numel() * v.element_size() for v in moments),
        "checkpoint_bytes": _tree_bytes(checkpoint),
        "trainable": sum(p.numel() for p in replica.params),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _child(folder: Path, modes: list[str], scratch: Path) -> list[dict[str, Any]]:
    """Each mode trained in turn by one child process; their results."""
    argv = [arg for mode in modes for arg in (str(folder), mode, str(scratch / mode))]
    done = zygote.run(
        [sys.executable, __file__, "--child", *argv],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return [
        json.loads(line[len(MARK) :]) for line in done.stdout.splitlines() if line.startswith(MARK)
    ]


def _row(name: str, value: float, unit: str, **kw: Any) -> dict:
    return Row(name=name, value=value, unit=unit, **kw).as_dict()


def run() -> list[dict]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        params = build_folder(scratch / "model")
        if ONE_CHILD:
            full, lora = _child(scratch / "model", ["full", "lora"], scratch)
        else:
            (full,) = _child(scratch / "model", ["full"], scratch)
            (lora,) = _child(scratch / "model", ["lora"], scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    opt = lora["optimizer_bytes"] / full["optimizer_bytes"]
    step = lora["step_s"] / full["step_s"]
    ckpt = lora["checkpoint_bytes"] / full["checkpoint_bytes"]
    return [
        _row("model parameters", params / 1e6, "M"),
        _row(
            "trainable parameters: LoRA (dim 16, all linear) vs full",
            lora["trainable"] / 1e6,
            "M",
            reference=full["trainable"] / 1e6,
            ratio=lora["trainable"] / full["trainable"],
        ),
        _row(
            "optimizer state bytes: LoRA vs full",
            lora["optimizer_bytes"] / 2**20,
            "MiB",
            reference=full["optimizer_bytes"] / 2**20,
            ratio=opt,
            target=f"<= {OPT_TARGET}",
            ok=opt <= OPT_TARGET,
        ),
        _row(
            "time per step: LoRA vs full",
            lora["step_s"] * 1e3,
            "ms",
            reference=full["step_s"] * 1e3,
            ratio=step,
            target="<= 1.0",
            ok=step <= 1.0,
        ),
        _row(
            "checkpoint bytes: LoRA vs full",
            lora["checkpoint_bytes"] / 2**20,
            "MiB",
            reference=full["checkpoint_bytes"] / 2**20,
            ratio=ckpt,
            target=f"< {CKPT_TARGET}",
            ok=ckpt < CKPT_TARGET,
        ),
        _row(
            "worker peak RSS: LoRA vs full",
            lora["peak_rss_mib"],
            "MiB",
            reference=full["peak_rss_mib"],
            ratio=lora["peak_rss_mib"] / full["peak_rss_mib"],
        ),
        _row(
            f"loss after {STEPS} steps: LoRA vs full (first: {lora['first_loss']:.3f})",
            lora["loss"],
            "nats",
            reference=full["loss"],
            ratio=lora["loss"] / full["loss"],
        ),
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        jobs = sys.argv[2:]
        for i in range(0, len(jobs), 3):
            print(MARK + json.dumps(train_child(*jobs[i : i + 3])), flush=True)
        sys.exit(0)
    from bench.table import render

    print(render(run()))

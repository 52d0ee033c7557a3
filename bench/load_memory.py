"""Host memory of a sharded start, a sharded checkpoint and its export, on a ~300M Llama.

A Llama of about 300M parameters is built offline and stored in bf16 over several
safetensors files, as a hub folder is. Two workers load it with FSDP
(``policy.dtensor_cfg.enabled=true``): each should read only its slices, so a worker's peak RSS
until its loaders are ready, less the same worker with the toy model, is compared with the
model's float32 bytes (target <= 0.6; a whole load holds >= 1.0, printed beside it with
``fsdp: false``). Build times of both groups are printed, not judged: the unsharded path is
unchanged code. A one-step sharded run then gives the runtime's own checkpoint (its bytes on
disk and the seconds its ``checkpoint_saved`` records), and ``sft-runtime export`` of it
runs as a child whose peak RSS comes from ``os.wait4``, less a bare ``import torch,
transformers`` measured the same way (target <= 0.5 of the float32 bytes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cli_runs  # noqa: E402
from bench import harness as h  # noqa: E402
from bench.table import Row  # noqa: E402
from tests.support import worker_probes  # noqa: E402

# the Llama: full ~294M parameters (hidden 1024, 16 layers, 32k vocabulary, untied head)
SHAPE = h.pick(
    {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 16},
    {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
)
HEADS = h.pick((16, 8), (4, 2))  # attention heads, KV heads
VOCAB = h.pick(32_768, 1_024)  # the tokenizer's ~512 tokens fit in either
FOLDER_SHARD = h.pick("200MB", "100KB")  # several files and an index, as on the hub
EXPORT_SHARD = h.pick("200MB", "100KB")  # the export's --max-shard-size for the target
LOAD_TARGET = 0.6
EXPORT_TARGET = 0.5
SAMPLES = h.pick(256, 64)
# Overrides of the groups whose start is measured (smoke: one worker each; a rank reads its
# slices the same way at any count, and the one-step run below trains on two)
GROUPS = h.pick([], ["cluster.workers_per_node=1"])
# The groups built: the toy model (the base both sides are measured from: with fsdp false it
# peaked 5 MiB lower, 0.004x here), the Llama sharded, the Llama whole. Smoke: the sharded
# group alone, standing for the other two; `load` is the same code for all three, and the
# unsharded start of an HF folder trains in tests/integration/policy/test_hf_training.py.
SIDES = h.pick(("base", "sharded", "unsharded"), ("sharded",))
T0 = time.monotonic()


def say(what: str) -> None:
    """Progress on stderr (the table goes to stdout): where a slow run spends its time."""
    print(f"load_memory.py: {time.monotonic() - T0:6.1f} s {what}", file=sys.stderr, flush=True)


def build_folder(out: Path) -> int:
    """A hub-like folder (tokenizer with a chat template, bf16 weights in shards); returns the
    parameter count. Stored in bf16 so the load pays a cast, as it does for real checkpoints."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.hf_models import demo_texts, train_tokenizer

    tok = train_tokenizer(out, demo_texts(), template="llama3")
    assert len(tok) <= VOCAB, (len(tok), VOCAB)
    config = LlamaConfig(
        vocab_size=VOCAB,
        num_attention_heads=HEADS[0],
        num_key_value_heads=HEADS[1],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        **SHAPE,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out), max_shard_size=FOLDER_SHARD)
    count = sum(p.numel() for p in model.parameters())
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1, "expected several files"
    return count


def configs(run_dir: Path, data: Path, folder: Path | None, fsdp: bool, *more: str) -> Any:
    """The tests' small run config, on the HF folder (or the toy model when None)."""
    from tests.support.small_run import small_config

    items = [f"policy.dtensor_cfg.enabled={str(fsdp).lower()}", "cluster.call_timeout_s=900"]
    if folder is not None:
        items += [
            f"policy.model_name={folder}",
            "data.max_input_seq_length=64",
        ]
    return small_config(run_dir, data, 1, *items, *more)


def load(config: Any, name: str) -> dict[str, Any]:
    """Seconds to build a group (workers started, joined, model loaded or sharded), then each
    worker's peak RSS once its loaders are ready: the whole start a run pays before step 1."""
    from sft_runtime.runtime.config import loader_spec
    from sft_runtime.runtime.data.factory import build_colocated_loader
    from sft_runtime.runtime.workers.group import PolicyWorkerGroup

    start = time.perf_counter()
    group = PolicyWorkerGroup(config.policy, config.cluster, seed=0, name=name)
    try:
        seconds = time.perf_counter() - start
        world = group.world_size
        spec, placement = loader_spec(config, world), h.placement_hash(world)
        group.setup_loaders(
            [partial(build_colocated_loader, spec, r, world, placement) for r in range(world)]
        )
        peak = max(worker_probes.peak_rss_bytes(group))
        storage = worker_probes.local_storage(group)
    finally:
        group.shutdown()
    return {"seconds": seconds, "peak": peak, "storage": storage}


# Run by a bare interpreter between the benchmark and the measured command. Linux carries
# the RSS of the process that forks into its child's ru_maxrss (a vfork child reports the
# parent's whole high-water mark), and this process holds the 300M model it just built; a
# child forked from this small reaper inherits only a few MiB, the same for every command.
REAPER = """
import os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status), time.perf_counter() - start)
"""


def child_peak(cmd: list[str]) -> tuple[int, float]:
    """Peak RSS (bytes) and wall seconds of one command: its own rusage from ``os.wait4``,
    so no sampling can miss a short peak and nothing else is counted."""
    done = subprocess.run(
        [sys.executable, "-S", "-c", REAPER, *cmd], capture_output=True, text=True, check=False
    )
    kib, code, seconds = done.stdout.split()[-3:] if done.returncode == 0 else ("0", "-1", "0")
    if int(code):
        raise RuntimeError(f"{cmd[:3]} exited {code}: {done.stderr[-2000:]}")
    return int(kib) * 1024, float(seconds)


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def one_step_run(data: Path, folder: Path, run_dir: Path) -> dict[str, Any]:
    """A real sharded run of one step saving at step 1: the checkpoint a user would export,
    with the optimizer's moments filled, and the save time the runtime itself records."""
    from sft_runtime.events import read_log, records_in_effect
    from sft_runtime.runtime.checkpoint.sharded import is_sharded
    from sft_runtime.runtime.launch.driver import run_training

    config = configs(run_dir, data, folder, True, "checkpointing.save_period=1")
    summary = run_training(config)
    assert summary["reason"] == "completed", summary
    saved = [r for r in records_in_effect(read_log(run_dir)) if r.type == "checkpoint_saved"]
    step_dir = run_dir / "checkpoints" / f"step_{saved[-1].data['step']}"
    assert is_sharded(step_dir / "policy" / "weights"), "the checkpoint is not sharded"
    return {"bytes": tree_bytes(step_dir), "seconds": saved[-1].data["seconds"]}


def row(name: str, value: float, unit: str, **kw: Any) -> dict:
    """A row whose target is enforced only in full mode (smoke figures mean nothing)."""
    if h.SMOKE:
        kw.pop("target", None)
        kw.pop("ok", None)
    return Row(name=name, value=value, unit=unit, **kw).as_dict()


def run() -> list[dict]:
    rows: list[dict] = []
    with h.workspace(samples=SAMPLES) as (data, tmp):
        folder = tmp / "llama"
        params = build_folder(folder)
        fp32 = params * 4
        say(f"built {params / 1e6:.1f}M params in {folder}")
        rows.append(
            row(f"model: Llama {params / 1e6:.1f}M params, fp32 bytes", fp32 / 2**20, "MiB")
        )
        got = {}
        for side in SIDES:
            model = None if side == "base" else folder
            fsdp = side != "unsharded"
            got[side] = load(configs(tmp / "r", data, model, fsdp, *GROUPS), f"load-{side}")
            say(f"loaded {side}: {got[side]['seconds']:.1f} s")
        for side in ("base", "unsharded"):  # smoke: the sharded group stands for them
            got.setdefault(side, got["sharded"])
        storage = got["sharded"]["storage"]
        if "start_read_local" not in storage[0]:
            raise RuntimeError("the sharded group did not take the sharded start (hf_shards)")
        read = max(s["start_read_local"] for s in storage) / storage[0]["start_read_full"]
        rows.append(row("sharded start: elements read by a rank / whole", read, "x"))
        for side in ("sharded", "unsharded"):
            peak, base = got[side]["peak"], got["base"]["peak"]
            rows.append(
                row(f"load peak RSS, {side} (max of 2 workers)", peak / 2**20, "MiB",
                    reference=base / 2**20, ratio=peak / base)
            )  # fmt: skip
            extra = (peak - base) / fp32
            sharded = side == "sharded"
            rows.append(
                row(
                    f"load (peak - toy base) / fp32 model bytes, {side}",
                    extra,
                    "x",
                    target=f"<= {LOAD_TARGET}" if sharded else "",
                    ok=extra <= LOAD_TARGET if sharded else None,
                )
            )
        whole, part = got["unsharded"]["seconds"], got["sharded"]["seconds"]
        rows.append(
            row("load time (group built), unsharded vs sharded", whole, "s",
                reference=part, ratio=whole / part)
        )  # fmt: skip
        rows.append(row("group build time, toy model (sharded)", got["base"]["seconds"], "s"))

        run_dir = tmp / "run"
        ckpt = one_step_run(data, folder, run_dir)
        say("one-step run done")
        rows.append(
            row("sharded checkpoint bytes on disk (weights+optimizer+rng+loaders)",
                ckpt["bytes"] / 2**20, "MiB", reference=fp32 / 2**20, ratio=ckpt["bytes"] / fp32)
        )  # fmt: skip
        rows.append(row("sharded checkpoint save time (checkpoint_saved)", ckpt["seconds"], "s"))

        bare, bare_s = child_peak([sys.executable, "-c", "import torch, transformers"])
        sizes = [EXPORT_SHARD] + h.pick(["5GB"], [])  # the default: the whole model in one file
        for size in sizes:
            out = tmp / f"export-{size}"
            peak, seconds = child_peak(
                [str(cli_runs.CLI), "export", str(run_dir), str(out), "--max-shard-size", size]
            )
            files = len(list(out.glob("*.safetensors")))
            say(f"exported with --max-shard-size {size}")
            shutil.rmtree(out, ignore_errors=True)
            extra = (peak - bare) / fp32
            gated = size == EXPORT_SHARD
            name = f"export --max-shard-size {size} ({files} files)"
            rows.append(
                row(f"{name}: peak RSS", peak / 2**20, "MiB",
                    reference=bare / 2**20, ratio=peak / bare)
            )  # fmt: skip
            rows.append(
                row(
                    f"{name}: (peak - bare import) / fp32 bytes",
                    extra,
                    "x",
                    target=f"<= {EXPORT_TARGET}" if gated else "",
                    ok=extra <= EXPORT_TARGET if gated else None,
                )
            )
            rows.append(
                row(f"{name}: time (bare import: reference)", seconds, "s", reference=bare_s)
            )
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    h.main(run, __doc__)

#!/usr/bin/env bash
# Short training on one GPU: cluster.gpus_per_node=1, workers_per_node=1, bfloat16.
# Prints tokens/s and the step-time breakdown. Skips (exit 0) when torch sees no CUDA GPU.
# Usage: bench/gpu_check.sh [STEPS]   (default 40; the whole check stays under 5 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
STEPS="${1:-40}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: SKIP - no CUDA GPU visible to torch (torch.cuda.is_available() is False" \
         "or torch is a CPU build); nothing to check"
    exit 0
fi

WORK="$(mktemp -d -t sft-gpu-check-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
export RAY_AUTH_MODE=disabled

timeout 280 "$PY" - "$WORK" "$STEPS" <<'PYEOF'
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*pin_memory.*")
sys.path.insert(0, ".")
import torch

from sft_runtime.runtime.config import validate_config
from sft_runtime.runtime.data.demo import build_demo_dataset
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.policy.replica import Replica as DPTrainer

work, steps = Path(sys.argv[1]), int(sys.argv[2])
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, NCCL {'yes' if torch.distributed.is_nccl_available() else 'NO'}")
raw = {
    "policy": {
        "model": {"vocab_size": 264, "d_model": 256, "n_layers": 4, "n_heads": 8,
                  "max_seq_len": 512},
        "train_global_batch_size": 32,
        "train_micro_batch_size": 8,
        "make_sequence_length_divisible_by": 8,
        "precision": "bfloat16",
    },
    "data": {
        "max_input_seq_length": 512,
        "train": {"path": str(work / "data"), "virtual_epoch_length": 1000},
        "energon": {"num_workers": 0, "shuffle_buffer_size": 64},
    },
    "sft": {"max_num_steps": steps, "seed": 1},
    "logger": {"log_dir": str(work / "run")},
    "cluster": {"workers_per_node": 1, "gpus_per_node": 1, "cpus_per_worker": 1},
    "checkpointing": {"enabled": True, "save_period": 20},
    "data_plane": {"max_partitions": 2},
}
config = validate_config(raw)

# 1. the trainer itself, no Ray: the model on CUDA, bf16 autocast on the forward
trainer = DPTrainer(config.policy, seed=1, device=torch.device("cuda", 0))
param_device = next(trainer.model.parameters()).device
ids = torch.randint(1, 264, (2, 64))
with trainer.autocast():
    logits = trainer.model(ids.cuda(), torch.arange(64).expand(2, 64).cuda(),
                           torch.zeros(2, 64, dtype=torch.long).cuda())
print(f"gpu_check: parameters on {param_device} ({next(trainer.model.parameters()).dtype}), "
      f"forward under autocast gives {logits.dtype}")
ok = param_device.type == "cuda" and logits.dtype == torch.bfloat16
del trainer, logits

# 2. a real run: Ray worker with one GPU (NCCL process group), energon, read-ahead on
build_demo_dataset(work / "data", num_samples=4096, seed=0)
t0 = time.time()
summary = run_training(config)
wall = time.time() - t0
rows = [json.loads(line) for line in open(work / "run" / "metrics.jsonl")]
steady = [r["train"] for r in rows[3:]] or [r["train"] for r in rows]

def med(key):
    values = [r[key] for r in steady if key in r]
    return statistics.median(values) if values else float("nan")

print(f"gpu_check: {summary['total_steps']} steps in {wall:.1f}s (with startup), "
      f"final loss {summary['last_loss']:.4f} (first {summary['first_loss']:.4f})")
print(f"gpu_check: valid tokens/s (median, steady) {med('valid_tokens_per_second'):,.0f}")
print("gpu_check: step-time breakdown, median ms over steady steps:")
for key in ("loader_latency_max", "load_time", "forward_backward_s", "allreduce_s",
            "optimizer_s", "policy_time", "total_step_time"):
    print(f"  {key:20s} {med(key) * 1e3:9.2f}")
ok = ok and summary["total_steps"] == steps and summary["last_loss"] < summary["first_loss"]
print("gpu_check: OK" if ok else "gpu_check: FAILED (see above)")
sys.exit(0 if ok else 1)
PYEOF

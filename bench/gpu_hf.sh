#!/usr/bin/env bash
# sft-runtime vs a plain torch FSDP2 loop on a ~1B Llama-architecture model (random weights,
# bf16 mixed precision, packed rows of 4096 tokens): on one GPU, then on all of them.
# Prints tokens/s, MFU, peak GPU memory and the ratio; skips (exit 0) without a CUDA GPU.
# Usage: bench/gpu_hf.sh [STEPS]   (default 12). Each run gets GPU_HF_LIMIT_S seconds (default
# 300): on a lent H200 with a cold Ray, 140 s was not enough for the one-GPU run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
STEPS="${1:-12}"
LIMIT="${GPU_HF_LIMIT_S:-300}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_hf: SKIP - no CUDA GPU visible to torch"
    exit 0
fi
export RAY_AUTH_MODE=disabled PYTHONWARNINGS=ignore
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
timeout "$LIMIT" "$PY" bench/gpu_hf.py --gpus 1 --steps "$STEPS"
if [ "$GPUS" -gt 1 ]; then
    timeout "$LIMIT" "$PY" bench/gpu_hf.py --gpus "$GPUS" --steps "$STEPS"
fi

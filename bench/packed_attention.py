"""Packed-row attention: a sample at a time with no mask, against the dense T x T mask.

One packed row of 8 equal samples through a tiny Llama, forward and backward, at growing T.
"segments" is the runtime's path (`runtime/policy/packed_attention.py`); "dense" is the path
it replaced: transformers' SDPA given the additive (1, 1, T, T) mask of `packed_attention_mask`.
Each (path, T) runs in a fresh process (smoke: both paths in one), so its peak RSS (less the
process's RSS just before the first forward) is the memory that path needed; time per row is
the median of the timed repeats after one warm-up. FlexAttention is not a side: torch 2.13
has no FlexAttention backward on CPU (NotImplementedError), so it cannot train here.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__:
    sys.path.insert(0, str(ROOT))

from bench import zygote  # noqa: E402
from bench.harness import SMOKE, pick  # noqa: E402
from bench.table import Row, render  # noqa: E402

SAMPLES = 8
# smoke: one length; every length runs the same code, and the growth row then reads 1
LENGTHS = pick([2_048, 4_096, 8_192, 16_384], [256])
REPEATS = pick(3, 1)
# Full: each (path, T) in a fresh process, so that its peak is its own. Smoke: one process
# measures both paths in turn, each through its own `_measure` (smoke figures mean nothing).
ONE_CHILD = pick(False, True)
VOCAB = 97
MEMORY_TARGET = 5.0  # segments' peak at 16k / at 4k: at most linear growth (4x) plus slack
MARK = "packed-attention: "
GATE_T = 4_096  # from here on the new path must use less memory and time than the dense one


def _measure(path: str, t: int, folder: str) -> dict:
    """In this (fresh) process: peak extra RSS and seconds per row of one path at length t."""
    import torch

    from sft_runtime.runtime.policy.hf_model import hf_logits, load_hf_model, packed_attention_mask

    torch.manual_seed(0)
    n = t // SAMPLES
    ids = torch.randint(0, VOCAB, (1, t))
    positions = torch.arange(n).repeat(SAMPLES).unsqueeze(0)
    segments = torch.arange(SAMPLES).repeat_interleave(n).unsqueeze(0)
    if path == "segments":
        model = load_hf_model(folder)

        def step() -> None:
            hf_logits(model, ids, positions, segments).square().mean().backward()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa"
        )

        def step() -> None:
            mask = packed_attention_mask(segments, torch.float32)
            out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False)
            out.logits.square().mean().backward()

    before = _rss_bytes()
    step()  # warm-up, and the peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(REPEATS):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_mb": max(peak, 0) / 2**20, "row_s": statistics.median(times)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _in_child(jobs: list[tuple[str, int]], folder: str) -> list[dict | None]:
    """Each (path, T) measured in turn by one fresh process; None for each where it did not
    end well (out of memory, most likely: the row says so)."""
    done = zygote.run(
        [sys.executable, __file__, "--one", folder, *(a for p, t in jobs for a in (p, str(t)))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or len(lines) != len(jobs):
        return [None] * len(jobs)
    return [json.loads(line[len(MARK) :]) for line in lines]


def _pair(name: str, t: int, new: float, old: float | None, unit: str) -> dict:
    """One figure of the new path beside the dense one; the target holds from T = 4,096 on."""
    ratio = None if old is None else new / old
    gated = t >= GATE_T and not SMOKE
    return Row(
        name=f"{name} T={t:,} ({SAMPLES} samples), segments vs dense",
        value=new,
        unit=unit,
        reference=old,
        ratio=ratio,
        target="< 1" if gated else "",
        ok=(ratio is None or ratio < 1) if gated else None,
    ).as_dict()


def run() -> list[dict]:
    from tests.support.hf_models import build_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-packed-") as tmp:
        build_model(tmp, family="llama", vocab_size=VOCAB, max_positions=max(LENGTHS))
        seg_peaks = {}
        for t in LENGTHS:
            if ONE_CHILD:
                new, old = _in_child([("segments", t), ("dense", t)], tmp)
            else:
                (new,) = _in_child([("segments", t)], tmp)
                (old,) = _in_child([("dense", t)], tmp)  # None: it ran out of memory
            if new is None:
                raise RuntimeError(f"the segments path failed at T={t}")
            seg_peaks[t] = new["peak_mb"]
            rows.append(_pair("peak memory", t, new["peak_mb"], old and old["peak_mb"], "MB"))
            rows.append(
                _pair("time per row", t, new["row_s"] * 1e3, old and old["row_s"] * 1e3, "ms")
            )
            print(f"packed_attention.py: T={t}: {rows[-2:]}", file=sys.stderr, flush=True)
        lo = LENGTHS[1] if len(LENGTHS) > 2 else LENGTHS[0]
        hi = LENGTHS[-1]
        growth = seg_peaks[hi] / seg_peaks[lo]
        rows.append(
            Row(
                name=f"segments peak memory growth, T={hi:,} over T={lo:,}",
                value=growth,
                unit="x",
                target="" if SMOKE else f"<= {MEMORY_TARGET}",
                ok=None if SMOKE else growth <= MEMORY_TARGET,
            ).as_dict()
        )
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        folder, jobs = sys.argv[2], sys.argv[3:]
        for i in range(0, len(jobs), 2):
            result = _measure(jobs[i], int(jobs[i + 1]), folder)
            print(MARK + json.dumps(result), flush=True)
    else:
        print(render(run()))

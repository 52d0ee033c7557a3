"""A sharded start from a Hugging Face folder, two readers: row slicing vs DCP's HF reader.

The Llama of bench/load_memory.py (its `build_folder`: ~300M parameters stored in bf16 over
several safetensors files and an index) is given to two FSDP2 ranks (gloo, CPU, two fresh
processes per measurement from `torch.multiprocessing.start_processes`, forked by a
forkserver that imported torch and transformers once: with plain ``spawn`` each rank pays
those imports again for every path, ~10 s on a busy 2-core machine). Each rank builds the
`hf_shards.skeleton` (parameters on the meta device), shards it with `fsdp.shard_model`, and
then fills its shards one of two ways:

- ``slicing``: `hf_shards.fill_from_folder`, the runtime's reader (one plain read of each
  tensor's local rows into a buffer of its own, cast to float32 as it is copied in);
- ``dcp``: `to_empty`, the buffers put back as the constructors computed them (what
  fill_from_folder does), then ``dcp.load(get_model_state_dict(model),
  storage_reader=HuggingFaceStorageReader(folder))``. The state dict's keys are the
  checkpoint's names for a Llama and its values are the float32 DTensor parameters
  themselves; DCP reads bf16 into them without complaint: its reader takes each slice
  through safetensors' memory map and ``copy_`` casts it. No bf16 detour is needed.

Per path: seconds to fill (the slower rank) and the rank's peak RSS growth over the fill
(VmHWM reset through ``/proc/self/clear_refs`` just before, less VmRSS then; file pages a
memory map touches count, as the kernel counts them), split into anonymous and file-backed
pages by sampling. Each path runs in fresh processes, so peaks never mix; rounds alternate
the order and the files are read once in the parent before each measurement, so both find
them in the page cache. Every local shard (and buffer) of both paths is digested: the two
must be bit-identical, and a difference is printed loudly on stderr and marked NO. Ratios
are DCP / slicing (median over rounds).
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench.load_memory import build_folder  # noqa: E402
from bench.table import Row  # noqa: E402

WORLD = 2
PATHS = ("slicing", "dcp")
ROUNDS = h.pick(2, 1)
# Each measurement gets two fresh processes, forked by a forkserver that imported these once
# (a spawned rank spends ~10 s importing them on a busy 2-core machine, for every path)
START = "forkserver"
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "safetensors.torch",
    "sft_runtime.runtime.policy.fsdp",
    "sft_runtime.runtime.policy.hf_shards",
]
T0 = time.monotonic()


def say(what: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(
        f"hf_start_readers.py: {time.monotonic() - T0:6.1f} s {what}", file=sys.stderr, flush=True
    )


# ------------------------------------------------------------------ in each rank
def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    wanted = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    got = dict.fromkeys(wanted, 0)
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":", 1)[0]
            if key in got:
                got[key] = int(line.split()[1]) * 1024
    return got


def _reset_peak() -> bool:
    """VmHWM back to the current RSS (Linux >= 4.0), so the next peak is the fill's own."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class _Sampler:
    """The largest anonymous and file-backed RSS seen while it runs (every few ms): what the
    kernel's VmHWM does not split. A short peak between two samples can be missed."""

    def __init__(self, every_s: float = 0.002) -> None:
        import threading

        self.every_s, self.peak = every_s, {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = _status()
            for key in self.peak:
                self.peak[key] = max(self.peak[key], now[key])
            self._stop.wait(self.every_s)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _digests(model: Any) -> dict[str, str]:
    """sha256 of the bytes of every local shard and buffer of this rank."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    named = [*model.named_parameters(), *(("buffer:" + n, b) for n, b in model.named_buffers())]
    for name, tensor in named:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        data = local.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
        out[name] = f"{local.dtype}:{tuple(local.shape)}:{hashlib.sha256(data).hexdigest()}"
    return out


def _local_bytes(model: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def _fill_slicing(model: Any, folder: str) -> None:
    import torch

    from sft_runtime.runtime.policy.hf_shards import fill_from_folder

    fill_from_folder(model, folder, torch.device("cpu"))


def _fill_dcp(model: Any, folder: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with torch.no_grad():
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        model.to_empty(device=torch.device("cpu"))
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])  # as the model's constructors computed them
    # the float32 DTensor parameters themselves, under the checkpoint's names (a Llama);
    # persistent buffers, if the model had any, would be in it too and be read by DCP
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(folder))


FILLS = {"slicing": _fill_slicing, "dcp": _fill_dcp}


def _rank(rank: int, port: int, folder: str, path: str, out: str) -> None:
    """One rank of one measurement: skeleton, shard, fill (measured), digest."""
    import torch
    import torch.distributed as dist

    from sft_runtime.runtime.policy import fsdp, rendezvous
    from sft_runtime.runtime.policy.config import DTensorConfig
    from sft_runtime.runtime.policy.hf_shards import skeleton

    torch.set_num_threads(1)  # two ranks on a shared machine
    rendezvous.join("gloo", rank, WORLD, port=port)
    try:
        model = skeleton(folder)
        parallel = DTensorConfig(enabled=True)
        fsdp.shard_model(model, parallel, fsdp.build_mesh(parallel, WORLD, torch.device("cpu")))
        gc.collect()
        dist.barrier()
        reset = _reset_peak()
        before = _status()
        with _Sampler() as sampled:
            start = time.perf_counter()
            FILLS[path](model, folder)
            seconds = time.perf_counter() - start
        after = _status()
        result = {
            "seconds": seconds,
            "peak_growth": after["VmHWM"] - (before["VmRSS"] if reset else before["VmHWM"]),
            "kept": after["VmRSS"] - before["VmRSS"],
            "anon_growth": sampled.peak["RssAnon"] - before["RssAnon"],
            "file_growth": sampled.peak["RssFile"] - before["RssFile"],
            "hwm_reset": reset,
            "local_bytes": _local_bytes(model),
            "digests": _digests(model),
        }
        Path(out, f"{path}-{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ in the benchmark
def _warm(folder: Path) -> None:
    """Every weight file read once, so each measurement finds them in the page cache."""
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as fh:
            while fh.read(16 << 20):
                pass


def measure(folder: Path, path: str, out: Path) -> list[dict[str, Any]]:
    """Both ranks' results for one path, each rank a fresh process."""
    import torch.multiprocessing as mp

    from sft_runtime.runtime.policy import rendezvous

    _warm(folder)
    store = rendezvous.serve()  # held until both ranks are done
    start = time.monotonic()
    mp.start_processes(
        _rank, args=(store.port, str(folder), path, str(out)), nprocs=WORLD, start_method=START
    )
    got = [json.loads((out / f"{path}-{r}.json").read_text()) for r in range(WORLD)]
    fill, peak = max(g["seconds"] for g in got), max(g["peak_growth"] for g in got)
    took = time.monotonic() - start
    say(f"{path}: fill {fill:.2f} s, peak growth {peak / 2**20:.0f} MiB (ranks ran {took:.1f} s)")
    return got


def compare(a: list[dict], b: list[dict]) -> list[str]:
    """Names of the local tensors whose digests differ between two paths (any rank)."""
    differ = []
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        for name in sorted(set(x["digests"]) | set(y["digests"])):
            if x["digests"].get(name) != y["digests"].get(name):
                differ.append(f"rank {rank}: {name}")
    return differ


def row(name: str, value: float, unit: str, **kw: Any) -> dict:
    """A row whose target is shown only in full mode (smoke figures mean nothing); the
    bit-identity check is enforced in both."""
    if h.SMOKE and kw.get("target") != "equal":
        kw.pop("target", None)
        kw.pop("ok", None)
    return Row(name=name, value=value, unit=unit, **kw).as_dict()


def run() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-hf-readers-") as tmp:
        folder = Path(tmp) / "llama"
        params = build_folder(folder)
        files = len(list(folder.glob("*.safetensors")))
        say(f"built {params / 1e6:.1f}M params in {files} files")
        multiprocessing.get_context(START).set_forkserver_preload(PRELOAD)
        results: dict[str, list[list[dict]]] = {p: [] for p in PATHS}
        for k in range(ROUNDS):
            order = PATHS if k % 2 == 0 else PATHS[::-1]
            for path in order:
                out = Path(tmp) / f"round{k}"
                out.mkdir(exist_ok=True)
                results[path].append(measure(folder, path, out))
    fp32 = params * 4

    def per_round(path: str, key: str) -> list[float]:
        return [max(g[key] for g in ranks) for ranks in results[path]]

    rows = [row(f"model: Llama {params / 1e6:.1f}M params, {files} bf16 files; fp32", fp32 / 2**20,
                "MiB")]  # fmt: skip
    shard = max(g["local_bytes"] for g in results["slicing"][0])
    times = {p: per_round(p, "seconds") for p in PATHS}
    peaks = {p: per_round(p, "peak_growth") for p in PATHS}
    kept = {p: per_round(p, "kept") for p in PATHS}
    sampled = {(p, k): statistics.median(per_round(p, f"{k}_growth")) / 2**20
               for p in PATHS for k in ("anon", "file")}  # fmt: skip
    t_ratio = statistics.median(d / s for d, s in zip(times["dcp"], times["slicing"], strict=True))
    m_ratio = statistics.median(d / s for d, s in zip(peaks["dcp"], peaks["slicing"], strict=True))
    rows += [
        row("fill time, slicing (fill_from_folder), max of 2 ranks",
            statistics.median(times["slicing"]), "s"),
        row("fill time, DCP (dcp.load, HuggingFaceStorageReader, casts bf16->fp32 itself)",
            statistics.median(times["dcp"]), "s",
            reference=statistics.median(times["slicing"]), ratio=t_ratio),
        row("fill peak RSS growth, slicing, max of 2 ranks (reference: fp32 shard)",
            statistics.median(peaks["slicing"]) / 2**20, "MiB", reference=shard / 2**20,
            ratio=statistics.median(peaks["slicing"]) / shard),
        row("fill peak RSS growth, DCP, max of 2 ranks (reference: slicing)",
            statistics.median(peaks["dcp"]) / 2**20, "MiB",
            reference=statistics.median(peaks["slicing"]) / 2**20, ratio=m_ratio),
        row("sampled peak anonymous RSS growth, DCP (reference: slicing)",
            sampled["dcp", "anon"], "MiB", reference=sampled["slicing", "anon"]),
        row("sampled peak file-backed RSS growth (mapped pages), DCP (reference: slicing)",
            sampled["dcp", "file"], "MiB", reference=sampled["slicing", "file"]),
        row("RSS kept after the fill, DCP (reference: slicing)",
            statistics.median(kept["dcp"]) / 2**20, "MiB",
            reference=statistics.median(kept["slicing"]) / 2**20,
            ratio=statistics.median(kept["dcp"]) / statistics.median(kept["slicing"])),
    ]  # fmt: skip
    differ = [d for k in range(ROUNDS) for d in compare(results["slicing"][k], results["dcp"][k])]
    count = sum(len(g["digests"]) for g in results["slicing"][0])
    if differ:
        banner = "!" * 78
        print(f"{banner}\nhf_start_readers.py: THE TWO PATHS GIVE DIFFERENT LOCAL SHARDS "
              f"({len(differ)} of {count} per round):", file=sys.stderr)  # fmt: skip
        for d in differ[:20]:
            print(f"  {d}", file=sys.stderr)
        print(banner, file=sys.stderr, flush=True)
    rows.append(
        row(f"local shards bit-identical, DCP vs slicing ({count} tensors over 2 ranks)",
            float(not differ), "bool", target="equal", ok=not differ)
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    h.main(run, __doc__)

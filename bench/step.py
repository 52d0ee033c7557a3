"""End-to-end step time of sft-runtime against a plain torch.distributed loop; resume time;
peak memory of every process; scaling over 1, 2 and 4 DP workers.

sft-runtime runs for real (`runtime.driver.run_training` or the `sft-runtime train` CLI):
Ray workers, energon loaders, the controller's state machine, events fsynced, a checkpoint
every 10 steps, metrics.jsonl, telemetry exported to a Jaeger file. Its step time is the mean
interval between consecutive ``step_committed`` records over the steady window (the first
WARMUP steps are startup), so commits, event appends, spans and checkpoints are all paid for.

The reference is the same training written as a plain loop: one subprocess of this file per
DP rank (no Ray), gloo, one torch thread, the same model, seed, optimizer, schedule, loss,
micro-batching and gradient all-reduce as `runtime.policy.trainer`, timed the same way (mean
interval between step ends). Two variants:

- ``pretokenized``: the batches come from a file written beforehand from the very loader
  stream sft-runtime trains on (so the losses agree, which the table checks): the loop does
  no loading at all. Target: sft-runtime <= 1.10x.
- ``inline``: each rank drives its own `ColocatedLoader` inline (load, train, commit), with a
  config where loading costs at least a third of a step. sft-runtime reads ahead
  (``data_plane.max_partitions=2``, energon ``num_workers=1``) on one DP worker, which leaves
  this 2-core machine a core to load on. Target: faster (< 1.0x). The same at DP=2 is shown
  without a target: two workers already fill both cores.

Sides alternate in rounds (reference, subject, reference, ...) because the machine is shared;
each ratio is the median of per-round ratios.

Resume: wall time from launching ``sft-runtime train`` to its first committed step, resumed
from a checkpoint at step 10 vs a cold start of the same config (target <= 1.2x). Peak RSS
(VmHWM) of the driver, the controller and each worker is read from /proc while those runs go.

Run ``python bench/step.py``; `run()` returns rows for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")  # energon's buffer-filling progress bars
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.table import render  # noqa: E402

WARMUP = 4  # committed steps treated as startup
STEPS = 22  # steps per measured run (checkpoints at 10 and 20)
ROUNDS = 2
OVERHEAD_ROUNDS = 3  # the headline ratio: one more round against this machine's noise
SEED = 5
OVERHEAD_TARGET = 1.10
RESUME_TARGET = 1.2
CLI = Path(sys.executable).parent / "sft-runtime"

# (a) compute-bound: a model big enough that loading is small next to a step
COMPUTE = {
    "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
    "seq": 128,
    "global_batch": 16,
    "micro": 4,
    "packing": False,
}
# (b) loading-heavy: a tiny model on long packed rows (many samples tokenized per row)
LOADING = {
    "model": {"d_model": 16, "n_layers": 1, "n_heads": 1, "max_seq_len": 256},
    "seq": 256,
    "global_batch": 32,
    "micro": 16,
    "packing": True,
}


# ------------------------------------------------------------------ configs
def raw_config(
    shape: dict,
    data: Path,
    run_dir: Path,
    steps: int,
    world: int = 2,
    prefetch: int = 1,
) -> dict[str, Any]:
    raw = {
        "policy": {
            "model": {"vocab_size": 264, **shape["model"]},
            "train_global_batch_size": shape["global_batch"],
            "train_micro_batch_size": shape["micro"],
            "optimizer": {"lr": 1e-3},
            "make_sequence_length_divisible_by": 8,
        },
        "data": {
            "max_input_seq_length": shape["seq"],
            "train": {"path": str(data), "virtual_epoch_length": 1000},
            "energon": {"num_workers": 0, "shuffle_buffer_size": 64},
        },
        "sft": {"max_num_steps": steps, "max_num_epochs": 1, "seed": SEED},
        "logger": {"log_dir": str(run_dir)},
        "cluster": {
            "workers_per_node": world,
            "cpus_per_worker": 0.5,
            "num_threads_per_worker": 1,
            "call_timeout_s": 300,
        },
        "checkpointing": {"enabled": True, "save_period": 10},
        "data_plane": {"max_partitions": prefetch},
        "telemetry": {"enabled": True, "exporters": ["jaeger_file"]},
    }
    if shape["packing"]:
        raw["policy"]["sequence_packing"] = {"enabled": True, "algorithm": "first_fit_decreasing"}
        raw["data"]["energon"]["packing_buffer_size"] = 4 * shape["global_batch"]
    return raw


def master_config(raw: dict):
    from sft_runtime.runtime.config import validate_config

    return validate_config(raw)


def loader_specs(config, world: int) -> list:
    """The LoaderSpec and logical rank of every DP rank, exactly as the controller builds them."""
    from sft_runtime.runtime.config import loader_spec

    spec = loader_spec(config, world)
    return [spec] * world


def placement_hash(world: int) -> str:
    from sft_runtime.runtime.data.placement import build_placement_plan

    axes = {
        "data_parallel": world,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "context_parallel": 1,
    }
    return build_placement_plan(axes, "default").placement_hash


# ------------------------------------------------------------------ the plain loop
class PlainLoop:
    """One rank of the plain torch.distributed loop (the math of `DPTrainer`, no Ray)."""

    def __init__(self, job: dict) -> None:
        import numpy as np
        import torch
        import torch.distributed as dist

        from sft_runtime.runtime.policy.loss import NLLLossFn
        from sft_runtime.runtime.policy.model import build_model

        self.torch, self.dist, self.job = torch, dist, job
        rank, world = job["rank"], job["world"]
        config = master_config(job["raw"])
        self.policy = config.policy
        torch.set_num_threads(1)
        random.seed(SEED + rank)
        np.random.seed(SEED + rank)
        torch.manual_seed(SEED + rank)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            self.model = build_model(self.policy.model)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = self.policy.optimizer
        self.opt = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.fn = NLLLossFn()
        self.steps_done = 0
        self.loader = None
        self.batches: list = []
        if job["batches"]:
            self.batches = torch.load(job["batches"], weights_only=False)[rank]
        else:
            from sft_runtime.runtime.data.loader import ColocatedLoader

            spec = loader_specs(config, world)[rank]
            self.loader = ColocatedLoader(spec, rank, world, placement_hash(world))
            self.loader.setup()

    def _batch(self, step: int):
        if self.loader is None:
            return self.batches[step]
        self.loader.load()
        return self.loader.active_batch

    def step(self, step: int) -> float:
        from sft_runtime.runtime.policy.schedule import lr_at

        torch, dist, fn = self.torch, self.dist, self.fn
        batch = self._batch(step)
        count = torch.tensor([float(fn.valid_tokens(batch)), 0.0], dtype=torch.float64)
        dist.all_reduce(count)
        total = int(count[0].item())
        self.model.zero_grad(set_to_none=True)
        size, nll = self.policy.train_micro_batch_size, 0.0
        for start in range(0, batch.num_rows, size):
            mb = batch.rows(start, min(start + size, batch.num_rows))
            logits = self.model(mb.input_ids, mb.position_ids, mb.segment_ids)
            loss, metrics = fn(logits, mb, total)
            loss.backward()
            nll += float(metrics["nll_sum"])
        grads = [p.grad for p in self.params]
        tail = torch.tensor([nll, 0.0], dtype=torch.float32)
        flat = torch.cat([g.reshape(-1) for g in grads] + [tail])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(p)
            offset += g.numel()
        torch.nn.utils.clip_grad_norm_(self.params, self.policy.max_grad_norm)
        lr = lr_at(self.steps_done, self.policy.optimizer.lr, self.policy.scheduler)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.model.zero_grad(set_to_none=True)
        self.steps_done += 1
        if self.loader is not None:
            self.loader.commit()
        return float(flat[-2].item()) / max(total, 1)

    def run(self) -> dict:
        times, losses = [], []
        for step in range(self.job["steps"]):
            losses.append(self.step(step))
            times.append(time.time())
        self.dist.destroy_process_group()
        if self.loader is not None:
            self.loader.close()
        return {"times": times, "losses": losses}


def plain_run(raw: dict, world: int, steps: int, batches: Path | None) -> dict:
    """Run the plain loop on `world` subprocesses; rank 0's step end times and losses."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        job = {
            "rank": rank,
            "world": world,
            "port": port,
            "raw": raw,
            "steps": steps,
            "batches": str(batches) if batches else None,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--plain", json.dumps(job)],
                stdout=subprocess.PIPE,
                cwd=ROOT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p in procs:
        if p.returncode:
            raise RuntimeError(f"plain loop rank exited with {p.returncode}")
    return json.loads(outs[0].strip().splitlines()[-1])


def pretokenize(raw: dict, world: int, steps: int, out: Path) -> Path:
    """The first `steps` batches of every rank's loader stream, saved for the plain loop."""
    import torch

    from sft_runtime.runtime.data.loader import ColocatedLoader

    config = master_config(raw)
    per_rank = []
    for rank, spec in enumerate(loader_specs(config, world)):
        loader = ColocatedLoader(spec, rank, world, placement_hash(world))
        loader.setup()
        batches = []
        for _ in range(steps):
            loader.load()
            batches.append(loader.active_batch)
            loader.commit()
        loader.close()
        per_rank.append(batches)
    torch.save(per_rank, out)
    return out


# ------------------------------------------------------------------ sft-runtime
def committed(run_dir: Path) -> list:
    from sft_runtime.events import read_log, records_in_effect

    return [r for r in records_in_effect(read_log(run_dir)) if r.type == "step_committed"]


def runtime_run(raw: dict) -> dict:
    """One sft-runtime run in this process (Ray started here); step end times and losses."""
    from sft_runtime.runtime.launch.driver import run_training

    run_training(master_config(raw))
    records = committed(Path(raw["logger"]["log_dir"]))
    return {
        "times": [r.time for r in records],
        "losses": [r.data["loss"] for r in records],
        "load": [r.data["timings"].get("loader_latency_max", 0.0) for r in records],
    }


def step_time(times: list[float]) -> float:
    """Mean seconds per step over the steady window (after WARMUP steps)."""
    window = times[WARMUP - 1 :]
    return (window[-1] - window[0]) / (len(window) - 1)


# ------------------------------------------------------------------ resume and memory
def _hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _role(proc) -> str | None:
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - gone
        return None
    if "PolicyWorker" in cmd:
        return f"worker:{proc.pid}"
    if "SFTController" in cmd or "SFTSingleController" in cmd:
        return "controller"
    return None


def cli_run(config_path: Path, run_dir: Path) -> dict:
    """`sft-runtime train`: seconds from launch to the first step committed by this launch,
    and the peak RSS (MiB) of the driver, the controller and the workers it started."""
    import psutil

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_AUTH_MODE"] = "disabled"
    before = len(committed(run_dir)) if (run_dir / "events.jsonl").exists() else 0
    start = time.time()
    proc = subprocess.Popen(
        [str(CLI), "train", str(config_path), "--run-dir", str(run_dir)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    peaks: dict[str, int] = {}
    driver = psutil.Process(proc.pid)
    while proc.poll() is None:
        peaks["driver"] = max(peaks.get("driver", 0), _hwm_kib(proc.pid))
        try:
            children = driver.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            role = _role(child)
            if role is not None:
                peaks[role] = max(peaks.get(role, 0), _hwm_kib(child.pid))
        time.sleep(0.2)
    if proc.returncode:
        raise RuntimeError(f"sft-runtime train exited with {proc.returncode}")
    records = committed(run_dir)[before:]
    workers = sorted(v for k, v in peaks.items() if k.startswith("worker:"))
    rss = {k: v / 1024 for k, v in peaks.items() if not k.startswith("worker:")}
    rss.update({f"worker{i}": v / 1024 for i, v in enumerate(workers)})
    return {"first_step_s": records[0].time - start, "rss": rss}


def resume_bench(data: Path, tmp: Path) -> tuple[list[float], list[float], dict]:
    """Cold start vs resume from step 10, alternating; first-step latencies and peak RSS."""
    import yaml

    prepared = tmp / "resume-base"
    base_raw = raw_config(COMPUTE, data, prepared, 10)
    runtime_run(base_raw)  # leaves a checkpoint at step 10
    cold, warm, rss = [], [], {}
    for i in range(ROUNDS):
        cold_dir = tmp / f"cold-{i}"
        cfg = tmp / f"cold-{i}.yaml"
        cfg.write_text(yaml.safe_dump(raw_config(COMPUTE, data, cold_dir, 12)))
        out = cli_run(cfg, cold_dir)
        cold.append(out["first_step_s"])
        rss = out["rss"]
        warm_dir = tmp / f"warm-{i}"
        shutil.copytree(prepared, warm_dir)
        cfg = tmp / f"warm-{i}.yaml"
        cfg.write_text(yaml.safe_dump(raw_config(COMPUTE, data, warm_dir, 12)))
        warm.append(cli_run(cfg, warm_dir)["first_step_s"])
    return cold, warm, rss


# ------------------------------------------------------------------ the benchmark
def _ray_up(tmp: Path) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        _temp_dir=str(tmp / "ray"),
    )


def row(name, value, unit, reference=None, target=None, ok=None, ratio=None) -> dict:
    if ratio is None and reference:
        ratio = value / reference
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "reference": reference,
        "ratio": ratio,
        "target": target or "",
        "ok": ok,
    }


PARTS = ("overhead", "prefetch", "scaling", "resume")


def run(parts: tuple[str, ...] = PARTS) -> list[dict]:
    import ray

    from sft_runtime.runtime.data.demo import build_demo_dataset

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    tmp = Path(tempfile.mkdtemp(prefix="bench-step-"))
    rows: list[dict] = []
    try:
        data = build_demo_dataset(tmp / "data", num_samples=4096, seed=0)
        _ray_up(tmp)
        benches = {"overhead": _overhead, "prefetch": _prefetch, "scaling": _scaling}
        for part, bench in benches.items():
            if part in parts:
                rows += bench(data, tmp)
        ray.shutdown()  # the resume runs start their own Ray, like a user's command
        if "resume" not in parts:
            return rows
        cold, warm, rss = resume_bench(data, tmp)
        c, w = statistics.median(cold), statistics.median(warm)
        ratio = statistics.median(b / a for a, b in zip(cold, warm, strict=True))
        rows.append(
            row(
                "step.resume_to_first_step",
                w,
                "s",
                c,
                f"<= {RESUME_TARGET}x cold",
                ratio <= RESUME_TARGET,
                ratio,
            )
        )
        for name in sorted(rss):
            rows.append(row(f"step.peak_rss.{name}", rss[name], "MiB"))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _overhead(data: Path, tmp: Path) -> list[dict]:
    """(a) sft-runtime (prefetch off and on) vs the plain loop on pre-tokenized batches."""
    batches = pretokenize(raw_config(COMPUTE, data, tmp, STEPS), 2, STEPS, tmp / "batches.pt")
    ref, off, on, r_off, r_on = [], [], [], [], []
    losses = None
    for i in range(OVERHEAD_ROUNDS):
        plain = plain_run(raw_config(COMPUTE, data, tmp, STEPS), 2, STEPS, batches)
        a = runtime_run(raw_config(COMPUTE, data, tmp / f"a-off-{i}", STEPS))
        b = runtime_run(raw_config(COMPUTE, data, tmp / f"a-on-{i}", STEPS, prefetch=2))
        t_ref, t_off, t_on = step_time(plain["times"]), step_time(a["times"]), step_time(b["times"])
        ref.append(t_ref)
        off.append(t_off)
        on.append(t_on)
        r_off.append(t_off / t_ref)
        r_on.append(t_on / t_ref)
        print(
            f"step.py: overhead round {i + 1}/{OVERHEAD_ROUNDS}: plain {t_ref * 1e3:.1f} ms, "
            f"sft-runtime {t_off * 1e3:.1f} ms, prefetch2 {t_on * 1e3:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
        losses = (plain["losses"], a["losses"], b["losses"])
    diff = max(max(abs(x - y), abs(x - z)) for x, y, z in zip(*losses, strict=True))
    ratio_off, ratio_on = statistics.median(r_off), statistics.median(r_on)
    ms = 1e3
    target = f"<= {OVERHEAD_TARGET}x"
    rows = [
        row(
            name,
            statistics.median(times) * ms,
            "ms",
            statistics.median(ref) * ms,
            target,
            ratio <= OVERHEAD_TARGET,
            ratio,
        )
        for name, times, ratio in (
            ("step.time.sft_runtime", off, ratio_off),
            ("step.time.sft_runtime_prefetch2", on, ratio_on),
        )
    ]
    extra = statistics.median(b - a for a, b in zip(ref, off, strict=True)) * ms
    return [
        *rows,
        row("step.overhead_per_step (sft-runtime - plain)", extra, "ms"),
        row("step.max_loss_diff_vs_plain", diff, "nats", None, "== 0", diff == 0.0),
    ]


def _prefetch(data: Path, tmp: Path) -> list[dict]:
    """(b) loading-heavy config: sft-runtime reading ahead vs the plain loop loading inline.

    The target row runs one DP worker, so the machine (2 cores here) has a core free to load
    on: ``max_partitions=2`` with energon ``num_workers=1`` builds the next batches in a
    loader process while the step trains. A read-ahead thread alone cannot win here: the
    byte tokenizer and a tiny model are both Python, so they take turns on the GIL. The DP=2
    rows show the other case on this machine: two workers already fill both cores, so
    there is no idle core to hide loading on (no target).
    """
    one = _loading_case(data, tmp, 1, {"num_workers": 1})
    two = _loading_case(data, tmp, 2, {})
    ms = 1e3
    return [
        row(
            "step.loading_heavy.dp1.sft_runtime_prefetch",
            one["on"] * ms,
            "ms",
            one["ref"] * ms,
            "< 1.0x (plain loads inline)",
            one["ratio_on"] < 1.0,
            one["ratio_on"],
        ),
        row(
            "step.loading_heavy.dp1.load_over_plain_step",
            one["load_frac"],
            "ratio",
            None,
            ">= 0.33",
            one["load_frac"] >= 1 / 3,
        ),
        row(
            "step.loading_heavy.dp1.loader_latency_max_prefetch",
            one["lat_on"] * ms,
            "ms",
            one["lat_off"] * ms,
        ),
        row("step.loading_heavy.dp2.sft_runtime_prefetch2", two["on"] * ms, "ms", two["ref"] * ms),
        row(
            "step.loading_heavy.dp2.sft_runtime_no_prefetch", two["off"] * ms, "ms", two["ref"] * ms
        ),
        row(
            "step.loading_heavy.dp2.loader_latency_max_prefetch2",
            two["lat_on"] * ms,
            "ms",
            two["lat_off"] * ms,
        ),
    ]


def _loading_case(data: Path, tmp: Path, world: int, energon_on: dict) -> dict[str, float]:
    """Plain inline loop, sft-runtime with read-ahead (``energon_on`` overrides) and without,
    alternating for ROUNDS rounds; medians of step times, ratios and loader latencies."""
    got: dict[str, list[float]] = {}

    def keep(**values: float) -> None:
        for key, value in values.items():
            got.setdefault(key, []).append(value)

    for i in range(ROUNDS):
        plain = plain_run(raw_config(LOADING, data, tmp, STEPS, world=world), world, STEPS, None)
        raw_on = raw_config(LOADING, data, tmp / f"b{world}-on-{i}", STEPS, world, prefetch=2)
        raw_on["data"]["energon"].update(energon_on)
        b = runtime_run(raw_on)
        a = runtime_run(raw_config(LOADING, data, tmp / f"b{world}-off-{i}", STEPS, world))
        t_ref, t_on, t_off = step_time(plain["times"]), step_time(b["times"]), step_time(a["times"])
        lat_off = statistics.median(a["load"][WARMUP:])
        keep(ref=t_ref, on=t_on, off=t_off, ratio_on=t_on / t_ref, load_frac=lat_off / t_ref)
        keep(lat_off=lat_off, lat_on=statistics.median(b["load"][WARMUP:]))
    return {key: statistics.median(values) for key, values in got.items()}


def _scaling(data: Path, tmp: Path) -> list[dict]:
    """(e) step time for 1, 2, 4 DP workers (0.5 CPU each), plain loop alongside."""
    rows = []
    for world in (1, 2, 4):
        raw = raw_config(COMPUTE, data, tmp / f"e-{world}", STEPS // 2 + WARMUP, world=world)
        steps = raw["sft"]["max_num_steps"]
        batches = pretokenize(raw, world, steps, tmp / f"batches-{world}.pt")
        plain = plain_run(raw, world, steps, batches)
        ours = runtime_run(raw)
        t_ref, t_ours = step_time(plain["times"]), step_time(ours["times"])
        rows.append(row(f"step.scaling.dp{world}", t_ours * 1e3, "ms", t_ref * 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated subset of {','.join(PARTS)} (default: all)",
    )
    args = parser.parse_args()
    if args.plain is not None:
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        print(json.dumps(PlainLoop(json.loads(args.plain)).run()), flush=True)
        return
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    print(render(run(parts)))


if __name__ == "__main__":
    main()

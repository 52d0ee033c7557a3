"""The reference of the end-to-end benchmarks: the same training as a plain loop.

One subprocess of this file per DP rank (no Ray), gloo, one torch thread, the same model,
seed, optimizer, schedule, loss, micro-batching and gradient all-reduce as
`sft_runtime.runtime.policy.replica`, timed the same way as sft-runtime (mean interval between
step ends). The batches come either from a file written beforehand from the very loader
stream sft-runtime trains on (`pretokenize`: the loop does no loading, and the losses
agree), or from a `ColocatedLoader` each rank drives inline (load, train, commit).

With ``policy.model_name`` the model is what a plain transformers script would use:
``AutoModelForCausalLM.from_pretrained`` and a forward with the usual 2-D padding mask, not
the runtime's loader and packed-row mask, so the comparison prices those too. That forward
only knows one sample per row: packed rows are refused.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import warnings
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(ROOT))

from bench import zygote  # noqa: E402
from bench.harness import SEED, loader_specs, master_config, placement_hash  # noqa: E402
from bench.timeline import PHASES  # noqa: E402


class PlainLoop:
    """One rank of the plain torch.distributed loop (the math of `Replica`, no Ray)."""

    def __init__(self, job: dict) -> None:
        import numpy as np
        import torch
        import torch.distributed as dist

        from sft_runtime.runtime.policy import rendezvous
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
        rendezvous.join("gloo", rank, world, port=job["port"])
        if self.policy.is_hf:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(
                self.policy.model_name,
                dtype=torch.float32,
                attn_implementation=self.policy.model.attn_implementation,
            )
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED)
                self.model = build_model(self.policy.model)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        from sft_runtime.runtime.policy.schedule import LrSchedule, build_optimizer

        o = self.policy.optimizer
        self.opt = build_optimizer(self.params, o.name, o.kwargs)
        self.schedule = LrSchedule(o.lr, self.policy.scheduler)
        self.fn = NLLLossFn()
        self.steps_done = 0
        self.phases: list[dict[str, float]] = []  # seconds of each phase, per step
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

    def _logits(self, mb):
        if not self.policy.is_hf:
            return self.model(mb.input_ids, mb.position_ids, mb.segment_ids)
        if int(mb.segment_ids.max()) > 0:
            raise ValueError("the plain HF forward takes one sample per row: turn packing off")
        mask = (mb.segment_ids >= 0).long()
        return self.model(input_ids=mb.input_ids, attention_mask=mask, use_cache=False).logits

    def step(self, step: int) -> float:
        torch, dist, fn = self.torch, self.dist, self.fn
        marks = [time.perf_counter()]
        batch = self._batch(step)
        marks.append(time.perf_counter())
        count = torch.tensor([float(fn.valid_tokens(batch)), 0.0], dtype=torch.float64)
        dist.all_reduce(count)
        total = int(count[0].item())
        self.model.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        size, nll = self.policy.train_micro_batch_size, 0.0
        for start in range(0, batch.num_rows, size):
            mb = batch.rows(start, min(start + size, batch.num_rows))
            logits = self._logits(mb)
            loss, metrics = fn(logits, mb, total)
            loss.backward()
            nll += float(metrics["nll_sum"])
        marks.append(time.perf_counter())
        grads = [p.grad for p in self.params]
        tail = torch.tensor([nll, 0.0], dtype=torch.float32)
        flat = torch.cat([g.reshape(-1) for g in grads] + [tail])
        dist.all_reduce(flat)
        marks.append(time.perf_counter())
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(p)
            offset += g.numel()
        torch.nn.utils.clip_grad_norm_(self.params, self.policy.max_grad_norm)
        lr = self.schedule.at(self.steps_done)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.model.zero_grad(set_to_none=True)
        self.steps_done += 1
        marks.append(time.perf_counter())
        self.phases.append({k: b - a for k, (a, b) in zip(PHASES, pairwise(marks), strict=True)})
        if self.loader is not None:
            self.loader.commit()
        return float(flat[-2].item()) / max(total, 1)

    def turns(self) -> dict:
        """Steps on demand (`PlainTurns`): read a count on stdin, run that many steps, print
        how long each took (the first from when the count arrived); 0 ends. Between turns
        the process waits on the pipe and takes no CPU."""
        print("ready", flush=True)
        losses: list[float] = []
        for line in sys.stdin:
            if int(line) == 0:
                break
            durations, start = [], time.perf_counter()
            for _ in range(int(line)):
                losses.append(self.step(len(losses)))
                now = time.perf_counter()
                durations.append(now - start)
                start = now
            print(json.dumps(durations), flush=True)
        self.dist.destroy_process_group()
        return {"losses": losses}

    def run(self) -> dict:
        times, cpu, losses = [], [], []
        for step in range(self.job["steps"]):
            losses.append(self.step(step))
            times.append(time.time())
            cpu.append(time.process_time())  # this rank's CPU, every thread, at the step's end
        self.dist.destroy_process_group()
        if self.loader is not None:
            self.loader.close()
        return {"times": times, "cpu": cpu, "losses": losses, "phases": self.phases}


def _start(job: dict, **popen: Any) -> subprocess.Popen:
    return zygote.Popen(
        [sys.executable, __file__, json.dumps(job)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        text=True,
        **popen,
    )


def plain_run(raw: dict, world: int, steps: int, batches: Path | None) -> dict:
    """Run the plain loop on `world` subprocesses; rank 0's step end times and losses, and
    every rank's CPU seconds at each step's end (``rank_cpu``)."""
    from sft_runtime.runtime.policy import rendezvous

    store = rendezvous.serve()  # held until every rank is done
    procs = []
    for rank in range(world):
        job = {
            "rank": rank,
            "world": world,
            "port": store.port,
            "raw": raw,
            "steps": steps,
            "batches": str(batches) if batches else None,
        }
        procs.append(_start(job))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p in procs:
        if p.returncode:
            raise RuntimeError(f"plain loop rank exited with {p.returncode}")
    ranks = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return {**ranks[0], "rank_cpu": [r["cpu"] for r in ranks]}


class PlainTurns:
    """One rank of the plain loop (DP=1, pretokenized batches) that trains when told to:
    `turn(n)` runs its next `n` steps and returns their durations."""

    def __init__(self, raw: dict, batches: Path) -> None:
        from sft_runtime.runtime.policy import rendezvous

        self._store = rendezvous.serve()  # held while the loop runs
        job = {"rank": 0, "world": 1, "port": self._store.port, "raw": raw, "steps": 0}
        self.proc = _start({**job, "batches": str(batches), "turns": True}, stdin=subprocess.PIPE)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the plain loop did not start (exit {self.proc.wait()})")

    def turn(self, steps: int) -> list[float]:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the plain loop exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> list[float]:
        """End the loop; the losses of every step it ran."""
        out, _ = self.proc.communicate("0\n", timeout=600)
        if self.proc.returncode:
            raise RuntimeError(f"the plain loop exited with {self.proc.returncode}")
        return json.loads(out.strip().splitlines()[-1])["losses"]


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


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    job = json.loads(sys.argv[1])
    loop = PlainLoop(job)
    print(json.dumps(loop.turns() if job.get("turns") else loop.run()), flush=True)
    # The figures are out. Skip the interpreter's teardown: a C++ thread of gloo or of the
    # loader's library, still joinable when its static destructor runs, once in a few runs
    # aborts the process there ("terminate called without an active exception").
    os._exit(0)

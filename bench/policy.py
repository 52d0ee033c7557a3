"""Step time of the Ray policy-worker group vs a plain torch.distributed loop.

Both sides train the same model on the same synthetic batches with the same number of
processes, one torch thread each, gloo on CPU. The baseline is two bare subprocesses of
this file (no Ray) running load -> token-count all-reduce -> micro-batch forward/backward
-> flat gradient all-reduce -> clip -> AdamW -> commit. The Ray side runs the runtime's
step calls three ways: `send_start`, `send_finish` and `commit_batches` each waited for
(three round trips a step, as an embedding user may drive the group phase by phase); one
`send_step` a step (the start, committing the batch before, and the finish in one call per
worker), waited for before the next is sent (one round trip a step); and as the controller
sends them, each step sent before the previous one is waited for, so a worker goes from one
step straight into the next and no round trip is left in the step (``sent_ahead``, whose
step time is the interval between two steps' results). The sides alternate in rounds
(baseline, group, baseline, ...) so that load from other processes on a shared machine hits
both alike; each ratio is the median of the per-round ratios of median step times. The
target, <= 1.10, is the runtime's own way of driving its workers (``sent_ahead``); the
other two show what a round trip to the workers costs an embedding user that waits for each
step, on a machine whose cores the workers fill (no target).

Run ``python bench/policy.py``; `run()` returns rows for an aggregator.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a script (the baseline ranks too): make `bench`, `tests` importable
    sys.path.insert(0, str(ROOT))

from bench import zygote  # noqa: E402
from bench.harness import pick  # noqa: E402
from tests.support import worker_probes  # noqa: E402

# processes a side (smoke: one; the group's calls take the same code at any size, and
# bench/load_memory.py trains a run on two workers end to end)
WORLD = pick(2, 1)
ROWS, SEQ_LEN, VOCAB, MICRO = 8, 128, 256, 4
WARMUP, ROUNDS, STEPS, SEED = 3, pick(5, 1), pick(8, 3), 11
TARGET = 1.10


def _sources():
    """The synthetic `BatchSource` of the policy tests; importing it registers it with
    cloudpickle to be shipped to Ray workers by value (they cannot import `tests`)."""
    from tests.support import sources

    return sources


def _configs():
    from sft_runtime.runtime.policy.cluster_config import ClusterConfig
    from sft_runtime.runtime.policy.config import ModelConfig, PolicyConfig

    policy = PolicyConfig(
        precision="float32",
        dtensor_cfg={"enabled": False},
        model=ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=SEQ_LEN),
        train_global_batch_size=WORLD * ROWS,
        train_micro_batch_size=MICRO,
        max_grad_norm=1.0,
    )
    cluster = ClusterConfig(workers_per_node=WORLD, cpus_per_worker=0.5, num_threads_per_worker=1)
    return policy, cluster


def _source(rank: int):
    src = _sources().SyntheticSource
    return functools.partial(src, SEED, rank, WORLD, rows=ROWS, seq_len=SEQ_LEN, vocab_size=VOCAB)


# ------------------------------------------------------------------ baseline (no Ray)
class _PlainLoop:
    """One process of the plain torch.distributed loop (what the runtime must not exceed)."""

    def __init__(self, rank: int, port: int) -> None:
        import torch.distributed as dist

        from sft_runtime.runtime.policy import rendezvous
        from sft_runtime.runtime.policy.loss import NLLLossFn
        from sft_runtime.runtime.policy.model import build_model
        from sft_runtime.runtime.policy.schedule import LrSchedule, build_optimizer

        torch.set_num_threads(1)
        self.dist = dist
        self.policy, _ = _configs()
        rendezvous.join("gloo", rank, WORLD, port=port)
        torch.manual_seed(0)
        self.model = build_model(self.policy.model)
        self.params = list(self.model.parameters())
        o = self.policy.optimizer
        self.opt = build_optimizer(self.params, o.name, o.kwargs)
        self.schedule = LrSchedule(o.lr, self.policy.scheduler)
        self.source, self.fn = _source(rank)(), NLLLossFn()
        self.source.setup(None)
        self.step_index = 0

    def step(self) -> tuple[float, float, float]:
        """One step; (seconds, forward/backward seconds, loss)."""
        dist, fn, params = self.dist, self.fn, self.params
        t0 = time.perf_counter()
        self.source.load()
        batch = self.source.active_batch
        count = torch.tensor([float(fn.valid_tokens(batch))], dtype=torch.float64)
        dist.all_reduce(count)
        total = int(count.item())
        self.opt.zero_grad(set_to_none=True)
        nll, t_fb = 0.0, time.perf_counter()
        for s in range(0, batch.num_rows, MICRO):
            mb = batch.rows(s, s + MICRO)
            logits = self.model(mb.input_ids, mb.position_ids, mb.segment_ids)
            loss, metrics = fn(logits, mb, total)
            loss.backward()
            nll += float(metrics["nll_sum"])
        t_fb = time.perf_counter() - t_fb
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.tensor([nll])])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, self.policy.max_grad_norm)
        lr = self.schedule.at(self.step_index)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.source.commit()
        self.step_index += 1
        return time.perf_counter() - t0, t_fb, float(flat[-1].item()) / max(total, 1)


def _baseline_child(rank: int, port: int) -> None:
    """Subprocess entry: one round of steps per line read from stdin, JSON out per round."""
    loop = _PlainLoop(rank, port)
    for _ in range(WARMUP):
        loop.step()
    for line in sys.stdin:
        if line.strip() != "go":
            break
        rows = [loop.step() for _ in range(STEPS)]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"rows": rows, "peak_rss": rss}), flush=True)
    loop.dist.destroy_process_group()


class _Baseline:
    def __init__(self) -> None:
        from sft_runtime.runtime.policy import rendezvous

        self._store = rendezvous.serve()  # held while the ranks run
        port = self._store.port
        cmd = [sys.executable, __file__, "--baseline-rank"]
        self.procs = [
            zygote.Popen(
                [*cmd, str(r), "--port", str(port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=ROOT,
                text=True,
            )
            for r in range(WORLD)
        ]

    def round(self) -> list[dict]:
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for p in self.procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"baseline process exited with code {p.wait(timeout=30)}")
            out.append(json.loads(line))
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.stdin:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


# ------------------------------------------------------------------ the worker group
class _Group:
    def __init__(self) -> None:
        import ray
        from ray import cloudpickle

        from sft_runtime.runtime.policy.loss import NLLLossFn
        from sft_runtime.runtime.workers.group import PolicyWorkerGroup

        self.ray = ray
        self.started = not ray.is_initialized()
        self.tmp = None  # Ray's session files when it is started here, removed by `close`
        if self.started:
            from bench.harness import ray_up

            self.tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
            ray_up(self.tmp)
        cloudpickle.register_pickle_by_value(_sources())  # as its import does; twice is harmless
        policy, cluster = _configs()
        self.fn = NLLLossFn()
        self.group = PolicyWorkerGroup(policy, cluster, seed=0, name="bench-policy")
        self.group.setup_loaders([_source(r) for r in range(WORLD)])
        self._finished = False  # a pipelined step's batch awaits the next start's commit
        for _ in range(WARMUP):
            self.step()

    def step(self) -> tuple[float, float, float]:
        """One step, each call waited for: start, finish, then the batch's commit (three
        round trips); (seconds, fwd/bwd seconds, loss)."""
        t0 = time.perf_counter()
        started = self.group.wait(self.group.send_start(self.fn, False))
        results = self.group.wait(self.group.send_finish())
        self.group.commit_batches()
        return time.perf_counter() - t0, started[0].forward_backward_s, results[0].loss

    def step_pipelined(self) -> tuple[float, float, float]:
        """The controller's call: the whole step in one call per worker, committing the
        previous step's batch first; one wait: one round trip."""
        t0 = time.perf_counter()
        out = self.group.wait(self.group.send_step(self.fn, self._finished))
        self._finished = True  # the next step commits this batch
        return time.perf_counter() - t0, out[0].started.forward_backward_s, out[0].finished.loss

    def round(self, pipelined: bool = False) -> list[tuple[float, float, float]]:
        step = self.step_pipelined if pipelined else self.step
        steps = [step() for _ in range(STEPS)]
        self._commit_last()
        return steps

    def round_sent_ahead(self) -> list[tuple[float, float, float]]:
        """STEPS steps as the controller sends them: step N+1 is sent before step N is waited
        for (committing N's batch if N finished); a step's seconds are the interval between
        its result and the one before (one step more is run, so every interval is a step's)."""
        steps = []
        pending = self.group.send_step(self.fn, self._finished)
        last = None
        for i in range(STEPS + 1):
            ahead = self.group.send_step(self.fn, True) if i < STEPS else None
            out = self.group.wait(pending)
            now = time.perf_counter()
            if last is not None:
                steps.append((now - last, out[0].started.forward_backward_s, out[0].finished.loss))
            last, pending = now, ahead
        self._finished = True
        self._commit_last()
        return steps

    def _commit_last(self) -> None:
        if self._finished:  # the last one-call step's batch: committed on its own
            self.group.commit_batches()
            self._finished = False

    def close(self) -> list[int]:
        try:
            return worker_probes.peak_rss_bytes(self.group)
        finally:
            self.group.shutdown()
            if self.started:
                self.ray.shutdown()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)


def _median_ms(rows: list, col: int) -> float:
    return statistics.median(r[col] for r in rows) * 1e3


def run() -> list[dict]:
    """Benchmark rows: name, value, unit, reference, ratio, target, ok."""
    base, group = _Baseline(), None
    base_rows, group_rows, piped_rows, ahead_rows, base_rss = [], [], [], [], []
    ratios, piped_ratios, ahead_ratios = [], [], []
    try:
        group = _Group()
        for _ in range(ROUNDS):
            b = base.round()
            g = group.round()
            gp = group.round(pipelined=True)
            ga = group.round_sent_ahead()
            ref = _median_ms(b[0]["rows"], 0)
            ratios.append(_median_ms(g, 0) / ref)
            piped_ratios.append(_median_ms(gp, 0) / ref)
            ahead_ratios.append(_median_ms(ga, 0) / ref)
            base_rows += b[0]["rows"]
            group_rows += g
            piped_rows += gp
            ahead_rows += ga
            base_rss = [r["peak_rss"] for r in b]
    finally:
        base.close()
        group_rss = group.close() if group is not None else []
    ratio, piped_ratio = statistics.median(ratios), statistics.median(piped_ratios)
    ahead_ratio = statistics.median(ahead_ratios)
    base_ms, group_ms = _median_ms(base_rows, 0), _median_ms(group_rows, 0)
    piped_ms, ahead_ms = _median_ms(piped_rows, 0), _median_ms(ahead_rows, 0)
    base_min, group_min = min(r[0] for r in base_rows) * 1e3, min(r[0] for r in group_rows) * 1e3
    # the group trains 2 x STEPS per round, the baseline STEPS: compare the first round
    loss_diff = max(abs(a[2] - b[2]) for a, b in zip(group_rows, base_rows[:STEPS], strict=False))
    rows = [
        _row(
            "policy.step_time.worker_group_sent_ahead", ahead_ms, "ms", base_ms, ahead_ratio, TARGET
        ),
        _row("policy.step_time.worker_group", group_ms, "ms", base_ms, ratio, None),
        _row("policy.step_time.worker_group_pipelined", piped_ms, "ms", base_ms, piped_ratio, None),
        _row("policy.step_time.torch_distributed", base_ms, "ms", None, None, None),
        _row("policy.step_time_min.worker_group", group_min, "ms", base_min, None, None),
        _row(
            "policy.forward_backward.worker_group",
            _median_ms(group_rows, 1),
            "ms",
            _median_ms(base_rows, 1),
            None,
            None,
        ),
        _row("policy.max_loss_diff_vs_baseline", loss_diff, "nats", None, None, None),
    ]
    for rank in range(WORLD):
        mib, ref = group_rss[rank] / 2**20, base_rss[rank] / 2**20
        rows.append(_row(f"policy.peak_rss.rank{rank}", mib, "MiB", ref, mib / ref, None))
    return rows


def _row(name, value, unit, reference, ratio, target) -> dict:
    if ratio is None and reference:
        ratio = value / reference
    ok = True if target is None else ratio <= target
    return {
        "name": name,
        "value": round(value, 4) if isinstance(value, float) else value,
        "unit": unit,
        "reference": None if reference is None else round(reference, 4),
        "ratio": None if ratio is None else round(ratio, 4),
        "target": target,
        "ok": ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_rank is not None:
        _baseline_child(args.baseline_rank, args.port)
        return
    for row in run():
        ratio = "" if row["ratio"] is None else f"  ratio {row['ratio']:.3f}"
        ref = "" if row["reference"] is None else f"  (reference {row['reference']})"
        target = "" if row["target"] is None else f"  target <= {row['target']}"
        flag = "ok" if row["ok"] else "OVER TARGET"
        print(f"{row['name']:40s} {row['value']:>10} {row['unit']}{ref}{ratio}{target}  {flag}")


if __name__ == "__main__":
    main()

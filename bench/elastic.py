"""What elastic shards cost a worker: G=4 data shards on W=2 workers against G=2 (one each).

One worker's loader, without Ray or a model, over the same global batch: with G=2 it is one
`ColocatedLoader` (shard 0 of 2, half the batch); with G=4 a `ShardGroupLoader` of shards 0
and 1 of 4 (a quarter each), which is what a run started on 4 workers and resumed on 2
loads. Each side runs in a child process of its own, alternating, ``ROUNDS`` times, with
``data.num_workers`` 0 (energon in the worker's thread) and 1 (NeMo RL's default: one loader
process per shard, so the group has two). Printed: the median seconds to load and commit a
step's batch, and the RSS of the child with its loader processes once they have run
(psutil, summed over the process tree). No target: the issue asks for the figure.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

if not __package__:  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench import zygote  # noqa: E402

GLOBAL_BATCH = 16
STEPS = h.pick(60, 6)
ROUNDS = h.pick(3, 1)
LOADER_PROCESSES = (0, 1)  # data.num_workers
MARK = "elastic-side: "


def child(data: str, shards: int, num_workers: int) -> dict:
    """One worker's loader of 2 (G=2) or 4 (G=4) shards: step seconds and tree RSS."""
    import psutil

    from sft_runtime.runtime.data.config import LoaderSpec
    from sft_runtime.runtime.data.loader import ColocatedLoader
    from sft_runtime.runtime.data.shards import ShardGroupLoader

    spec = LoaderSpec(
        data_path=data,
        batch_size=GLOBAL_BATCH // shards,
        seed=h.SEED,
        shuffle_buffer_size=64,
        num_workers=num_workers,
        max_input_seq_length=256,
        pad_multiple=8,
        overlong_samples="truncate",
    )
    mine = list(range(shards // 2))  # worker 0 of 2
    parts = [partial(ColocatedLoader, spec, s, shards, "bench-elastic") for s in mine]
    loader = parts[0]() if len(parts) == 1 else ShardGroupLoader(parts)
    loader.setup(None)
    seconds = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loader.load()
        loader.commit()
        seconds.append(time.perf_counter() - start)
    me = psutil.Process()
    rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
    loader.close()
    warm = seconds[len(seconds) // 3 :]  # the first batches also start the loader processes
    return {"step_s": statistics.median(warm), "rss": rss}


def _side(data: Path, shards: int, num_workers: int) -> dict:
    done = zygote.run(
        [sys.executable, __file__, "--child", str(data), str(shards), str(num_workers)],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith(MARK))
    return json.loads(line[len(MARK) :])


def run() -> list[dict]:
    rows = []
    with h.workspace(ray=False, samples=h.pick(2048, 256)) as (data, _):
        for num_workers in LOADER_PROCESSES:
            got: dict[int, list[dict]] = {2: [], 4: []}
            for _ in range(ROUNDS):  # alternating, so drift hits both sides alike
                for shards in (2, 4):
                    got[shards].append(_side(data, shards, num_workers))
            step = {g: statistics.median(r["step_s"] for r in got[g]) for g in got}
            rss = {g: statistics.median(r["rss"] for r in got[g]) for g in got}
            where = f"elastic.num_workers{num_workers}"
            rows.append(h.row(f"{where}.load_step_g4_on_w2", step[4] * 1e3, "ms", step[2] * 1e3))
            rows.append(h.row(f"{where}.rss_g4_on_w2", rss[4] / 2**20, "MiB", rss[2] / 2**20))
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        data, shards, num_workers = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(MARK + json.dumps(child(data, shards, num_workers)), flush=True)
        sys.exit(0)
    h.main(run, __doc__)

"""Event log cost: appends (plain and fsynced) and replay of a 1M-record log vs bare parsing.

Run: python bench/events.py [--records 1000000] [--appends 100000] [--durable 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import pick  # noqa: E402
from bench.table import Row, render  # noqa: E402
from sft_runtime.events import LoadersReady, RunStarted, StepCommitted, open_log, read_log  # noqa: E402
from sft_runtime.states import replay  # noqa: E402


def _step(step: int) -> StepCommitted:
    return StepCommitted(
        step=step,
        source_samples=32,
        valid_tokens=4000 + step % 97,
        physical_packs=32,
        loss=1.0 / (1 + step),
        grad_norm=0.25,
        lr=3e-4,
        timings={"loader_latency_max": 0.001, "policy_time": 0.04, "total_step_time": 0.045},
        sample_digests=["0123456789abcdef", "fedcba9876543210"],
        trace_id="0" * 32,
        span_id="0" * 16,
    )


def _append(run_dir: Path, count: int, durable: bool, start: int = 1) -> float:
    with open_log(run_dir, fsync=True) as log:
        if log.next_seq == 0:
            log.append(RunStarted(placement_hash="h" * 64))
            log.append(LoadersReady(owner_ranks=[0, 1], logical_world_size=2, restored=False))
        events = [_step(s) for s in range(start, start + count)]
        t0 = time.perf_counter()
        for ev in events:
            log.append(ev, durable=durable)
        return time.perf_counter() - t0


def _bare_parse(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=1 << 20) as fh:
        for line in fh:
            orjson.loads(line)
    return time.perf_counter() - t0


def _replay(path: Path, steps: int) -> float:
    t0 = time.perf_counter()
    state = replay(read_log(path))
    secs = time.perf_counter() - t0
    assert state.total_steps == steps
    return secs


RECORDS = pick(1_000_000, 2_000)
APPENDS = pick(100_000, 1_000)
DURABLE = pick(2_000, 50)
ROUNDS = pick(5, 1)  # interleaved rounds of bare parsing and replay
REPLAY_TARGET = 2.5


def run(records: int = RECORDS, appends: int = APPENDS, durable: int = DURABLE) -> list[dict]:
    rows = []
    # full: fsync on the disk the repository is on; smoke: the system's temporary folder
    with tempfile.TemporaryDirectory(dir=pick(Path.cwd(), None)) as tmp:
        plain_dir, durable_dir, big_dir = Path(tmp, "plain"), Path(tmp, "durable"), Path(tmp, "big")
        secs = _append(plain_dir, appends, durable=False)
        rows.append(Row(f"append ({appends:,} records, no fsync)", appends / secs, "records/s"))
        secs = _append(durable_dir, durable, durable=True)
        ms = 1000 * secs / durable
        rows.append(
            Row(f"durable append ({durable:,}, fsync)", ms, "ms/record", target="< 2 ms", ok=ms < 2)
        )
        _append(big_dir, records - 2, durable=False)
        path = big_dir / "events.jsonl"
        # each round times both sides back to back, so the machine's load hits them alike;
        # the figure is the median of the rounds' ratios
        bare, secs, ratios = [], [], []
        for _ in range(ROUNDS):
            bare.append(_bare_parse(path))
            secs.append(_replay(path, records - 2))
            ratios.append(secs[-1] / bare[-1])
        ratio = statistics.median(ratios)
        rows.append(
            Row(
                f"replay ({records:,} records)",
                records / statistics.median(secs),
                "records/s",
                reference=records / statistics.median(bare),
                ratio=ratio,
                target=f"time <= {REPLAY_TARGET}x bare orjson.loads (median of {ROUNDS})",
                ok=ratio <= REPLAY_TARGET,
            )
        )
        rows.append(Row("log size", path.stat().st_size / 2**20, "MiB"))
    return [r.as_dict() for r in rows]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=RECORDS)
    parser.add_argument("--appends", type=int, default=APPENDS)
    parser.add_argument("--durable", type=int, default=DURABLE)
    a = parser.parse_args()
    print(render(run(a.records, a.appends, a.durable)))

"""Colocated loader cost: samples/s against plain energon with the same task encoder, and the
cost of state_dict() and abort().

Both sides read the same demo data set with the same encoder, batch size and packing, measured
in the same run, alternating, median of a few rounds (the machine is shared).

Run: python bench/loader.py [--samples 2048] [--batches 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import SMOKE, pick  # noqa: E402
from bench.table import Row, render  # noqa: E402
from sft_runtime.runtime.data.config import LoaderSpec  # noqa: E402
from sft_runtime.runtime.data.demo import build_demo_dataset  # noqa: E402
from sft_runtime.runtime.data.loader import ColocatedLoader  # noqa: E402

BATCH = 32
SEQ = 256
PACKING = {"packing_algorithm": "first_fit_decreasing"}
SAMPLES = pick(2048, 512)
BATCHES = pick(48, 3)
ROUNDS = pick(5, 1)
TARGETS = {False: 0.8, True: 0.9}  # loader samples/s against plain energon, by packing
CALLS = pick(30, 3)  # state_dict() and abort() calls timed


def _spec(path: Path, packing: bool) -> LoaderSpec:
    return LoaderSpec(
        data_path=str(path),
        batch_size=BATCH,
        seed=1,
        shuffle_buffer_size=64,
        max_input_seq_length=SEQ,
        pad_multiple=8,
        **(PACKING if packing else {}),
    )


def _plain_energon(spec: LoaderSpec, batches: int) -> float:
    """samples/s of a bare energon loop over the same data set and task encoder."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from sft_runtime.runtime.data.task_encoder import SFTTaskEncoder
    from sft_runtime.runtime.data.tokenizer import build_tokenizer

    encoder = SFTTaskEncoder(
        build_tokenizer(spec.tokenizer),
        max_input_seq_length=spec.max_input_seq_length,
        pad_multiple=spec.pad_multiple,
        packing_algorithm=spec.packing_algorithm,
    )
    dataset = get_train_dataset(
        spec.data_path,
        split_part="train",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0, seed_offset=spec.seed),
        batch_size=spec.batch_size,
        shuffle_buffer_size=spec.shuffle_buffer_size,
        max_samples_per_sequence=None,
        task_encoder=encoder,
    )
    loader = get_savable_loader(dataset, gc_collect_every_n_steps=0, watchdog_timeout_seconds=None)
    it = iter(loader)
    next(it)  # fill buffers outside the clock, like the other side
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        samples += len(next(it).source_ids)
    return samples / (time.perf_counter() - start)


def _ours(spec: LoaderSpec, batches: int) -> float:
    loader = ColocatedLoader(spec, 0, 1, "bench")
    loader.setup()
    try:
        loader.load()
        loader.commit()
        start, samples = time.perf_counter(), 0
        for _ in range(batches):
            samples += len(loader.load().source_ids)
            loader.commit()
        return samples / (time.perf_counter() - start)
    finally:
        loader.close()


def _per_call_ms(spec: LoaderSpec, calls: int) -> tuple[float, float]:
    """Median ms of state_dict() and of abort() (abort includes the loader rebuild)."""
    loader = ColocatedLoader(spec, 0, 1, "bench")
    loader.setup()
    state_ms, abort_ms = [], []
    try:
        for _ in range(calls):
            loader.load()
            loader.commit()
            t0 = time.perf_counter()
            loader.state_dict()
            state_ms.append((time.perf_counter() - t0) * 1e3)
            loader.load()
            t0 = time.perf_counter()
            loader.abort()
            abort_ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        loader.close()
    return sorted(state_ms)[len(state_ms) // 2], sorted(abort_ms)[len(abort_ms) // 2]


def run(samples: int = SAMPLES, batches: int = BATCHES, rounds: int = ROUNDS) -> list[dict]:
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_demo_dataset(Path(tmp) / "demo", num_samples=samples)
        for packing in (False, True):
            spec = _spec(path, packing)
            # rounds alternate the sides, so the machine's load hits both alike; each
            # figure is the median over the rounds, the ratio the median of theirs
            plain, ours, ratios = [], [], []
            for _ in range(rounds):
                plain.append(_plain_energon(spec, batches))
                ours.append(_ours(spec, batches))
                ratios.append(ours[-1] / plain[-1])
            ratio = statistics.median(ratios)
            label = "packed" if packing else "unpacked"
            rows.append(
                Row(
                    name=f"loader samples/s ({label}, batch {BATCH})",
                    value=statistics.median(ours),
                    unit="samples/s",
                    reference=statistics.median(plain),
                    ratio=ratio,
                    target=f">= {TARGETS[packing]}x plain energon (median of {rounds})",
                    ok=ratio >= TARGETS[packing],
                )
            )
        state_ms, abort_ms = _per_call_ms(_spec(path, False), calls=CALLS)
        rows.append(
            Row(
                name="state_dict() (num_workers=0)",
                value=state_ms,
                unit="ms",
                target="< 5 ms",
                ok=state_ms < 5.0,
            )
        )
        rows.append(Row(name="abort() incl. loader rebuild", value=abort_ms, unit="ms"))
    return [row.as_dict() for row in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--batches", type=int, default=BATCHES)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    rows = run(samples=args.samples, batches=args.batches, rounds=args.rounds)
    print(render(rows))
    if SMOKE:  # smoke mode checks that it runs, not its figures
        return 0
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the end-to-end benchmarks share: the configs, a run of sft-runtime and of its CLI,
step times, peak memory, the result rows, and a workspace with a data set and Ray.

sft-runtime runs for real (`sft_runtime.runtime.launch.driver.run_training` or the
`sft-runtime train` CLI): Ray workers, energon loaders, the controller's state machine,
events fsynced, a checkpoint every 10 steps, metrics.jsonl, telemetry exported to a Jaeger
file. Its step time is the mean interval between consecutive ``step_committed`` records over
the steady window (the first WARMUP steps are startup), so commits, event appends, spans and
checkpoints are all paid for. The reference is `bench/plain_loop.py`. Sides alternate in
rounds (reference, subject, reference, ...) because the machine is shared; each ratio is the
median of per-round ratios.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(ROOT))

# Smoke mode (`bench/run_all.py --smoke`, which sets this for its children): every benchmark
# runs through the same code with tiny sizes, few steps and one round, to show that it runs
# and prints its rows; its figures mean nothing and no target is enforced. Read here only.
SMOKE_ENV = "SFT_BENCH_SMOKE"
SMOKE = os.environ.get(SMOKE_ENV) == "1"
# Smoke mode only: the Ray that a benchmark's runs share (`shared_ray`: the one
# `run_all.py --smoke` starts for all its benchmarks, or a benchmark's own), its GCS address
# and the pid of the process that started it. A Ray start costs a 2-core machine several
# seconds of CPU, and a smoke run would otherwise pay it a dozen times (once per benchmark,
# once more per `sft-runtime train` a benchmark launches).
SHARED_RAY_ENV = "SFT_BENCH_SHARED_RAY"
SHARED_RAY_PID_ENV = "SFT_BENCH_SHARED_RAY_PID"
# Smoke mode only: one OpenMP thread (torch's intra-op pool) in every process of the run
# (`run_all.py --smoke` sets these for its children, and Ray's workers inherit them). Two
# benchmarks share the cores then, and a team of two threads spin-waits for a core another
# process holds: a step of a tiny model took seconds instead of tens of milliseconds on 2
# cores. Full runs keep each process's own setting.
SMOKE_THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pick(full, smoke):
    """``full`` in a real run, ``smoke`` in smoke mode (`SMOKE`)."""
    return smoke if SMOKE else full


WARMUP = 4  # committed steps treated as startup
# steps per measured run (full: checkpoints at 10 and 20); the window after WARMUP (steps 5 to
# 24) holds two whole save periods, so checkpoints weigh in at their real rate of 1 in 10
STEPS = pick(24, WARMUP + 3)
SAVE_PERIOD = pick(10, 3)  # checkpointing.save_period (smoke: saves inside its few steps)
ROUNDS = pick(2, 1)
# steps per run of the end-to-end ratios held to a target (`overhead.py`, `scaling.py`): a
# steady window of 4 whole save periods, long enough that a slow spell of the machine weighs
# little in it
LONG_STEPS = pick(WARMUP + 4 * SAVE_PERIOD, STEPS)
CORE_EACH_TARGET = 1.05  # the end-to-end ratio where every worker and the controller have a core
SAMPLES = pick(4096, 1024)  # demo samples in a `workspace` data set
SEED = 5
RESUME_TARGET = 1.2

# (a) compute-bound: a model big enough that loading is small next to a step (smoke: a
# smaller one, the same rows and micro-batches)
COMPUTE = {
    "model": pick(
        {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
        {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 128},
    ),
    "seq": 128,
    "global_batch": 16,
    "micro": 4,
    "packing": False,
}
# (b) loading-heavy: a tiny model on many short packed rows (several samples tokenized per
# row; rows of 128, not longer ones, because a packed row's attention grows with its length
# squared and its loading only with its length; smoke: half the rows, in as many
# micro-batches)
LOADING = {
    "model": {"d_model": 16, "n_layers": 1, "n_heads": 1, "max_seq_len": 128},
    "seq": 128,
    "global_batch": pick(64, 32),
    "micro": pick(32, 16),
    "packing": True,
}


# ------------------------------------------------------------------ configs
# The values these benchmarks were measured with where a key left out now reads as NeMo
# RL's default (bfloat16, FSDP2, BOS added, TensorBoard and GPU monitoring on, 3 checkpoints
# kept, a GPU where one is seen): stated, so that runs stay comparable with bench/RESULTS.md
# and the plain loop (float32, a whole replica per rank) trains the same model.
POLICY_AS_MEASURED = {"precision": "float32", "dtensor_cfg": {"enabled": False}}
DATA_AS_MEASURED = {"add_bos": False, "add_generation_prompt": True}
LOGGER_AS_MEASURED = {"tensorboard_enabled": False, "monitor_gpus": False}


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
            "optimizer": {"kwargs": {"lr": 1e-3}},
            "make_sequence_length_divisible_by": 8,
            **POLICY_AS_MEASURED,
        },
        "data": {
            "max_input_seq_length": shape["seq"],
            "train": {"path": str(data), "virtual_epoch_length": 1000},
            "num_workers": 0,
            "energon": {"shuffle_buffer_size": 64},
            **DATA_AS_MEASURED,
        },
        "sft": {"max_num_steps": steps, "max_num_epochs": 1, "seed": SEED},
        "logger": {"log_dir": str(run_dir), **LOGGER_AS_MEASURED},
        "cluster": {
            "gpus_per_node": 0,
            "workers_per_node": world,
            "cpus_per_worker": 0.5,
            "num_threads_per_worker": 1,
            "call_timeout_s": 300,
        },
        "checkpointing": {"enabled": True, "save_period": SAVE_PERIOD, "keep_top_k": None},
        "data_plane": {"max_partitions": prefetch},
        "telemetry": {"enabled": True, "exporters": ["jaeger_file"]},
    }
    if shape["packing"]:
        raw["policy"]["sequence_packing"] = {"enabled": True, "algorithm": "first_fit_decreasing"}
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


# ------------------------------------------------------------------ sft-runtime
def committed(run_dir: Path) -> list:
    from sft_runtime.events import read_log, records_in_effect

    return [r for r in records_in_effect(read_log(run_dir)) if r.type == "step_committed"]


def runtime_run(raw: dict, on_step=None) -> dict:
    """One sft-runtime run in this process (Ray started here); step end times and losses.
    ``on_step`` gets each committed step's metrics row, as `run_training` hands it over."""
    from sft_runtime.runtime.launch.driver import run_training

    run_training(master_config(raw), on_step=on_step)
    records = committed(Path(raw["logger"]["log_dir"]))
    return {
        "steps": [r.data["step"] for r in records],
        "times": [r.time for r in records],
        "losses": [r.data["loss"] for r in records],
        "load": [r.data["timings"].get("loader_latency_max", 0.0) for r in records],
        "model_work": [_model_work(r.data["timings"]) for r in records],
    }


def _model_work(timings: dict) -> float:
    """Seconds of a step the plain loop spends too: forward/backward, gradient all-reduce,
    optimizer (as the worker timed them)."""
    return sum(timings.get(k, 0.0) for k in ("forward_backward_s", "allreduce_s", "optimizer_s"))


def save_cost(run: dict, save_period: int) -> float:
    """Seconds a checkpoint adds to the step after it (a `runtime_run` with a save every
    ``save_period`` steps): that step's interval beyond its model work, less the median of
    the same over the other steps of the steady window."""
    import statistics

    extra = {}
    for k in range(WARMUP, len(run["times"])):
        interval = run["times"][k] - run["times"][k - 1]
        extra[run["steps"][k]] = interval - run["model_work"][k]
    after = [v for step, v in extra.items() if (step - 1) % save_period == 0]
    others = [v for step, v in extra.items() if (step - 1) % save_period != 0]
    return statistics.mean(after) - statistics.median(others)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def core_each(world: int) -> bool:
    """Whether there is a core for each of ``world`` workers and one more (the controller,
    Ray and the driver)."""
    return usable_cores() >= world + 1


def step_time(times: list[float]) -> float:
    """Mean seconds per step over the steady window (after WARMUP steps)."""
    window = times[WARMUP - 1 :]
    return (window[-1] - window[0]) / (len(window) - 1)


# ------------------------------------------------------------------ the benchmark
@contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """``os.environ`` with these values for the block (None: unset), as it was after it."""

    def put(key: str, value: str | None) -> None:
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            put(key, value)
        yield
    finally:
        for key, value in saved.items():
            put(key, value)


def shared_ray_address() -> str | None:
    """The GCS address of the Ray this benchmark's runs share in smoke mode (`shared_ray`),
    None when they start their own."""
    return os.environ.get(SHARED_RAY_ENV) if SMOKE else None


def ray_root():
    """The process whose descendants are this benchmark's Ray processes (raylet, workers,
    controllers): the one that started the shared Ray in smoke mode, else this one."""
    import psutil

    pid = os.environ.get(SHARED_RAY_PID_ENV) if shared_ray_address() else None
    return psutil.Process(int(pid) if pid else os.getpid())


@contextmanager
def shared_ray(temp_dir: Path) -> Iterator[None]:
    """Smoke mode: a local Ray (session files under ``temp_dir``) that every run started
    from this process or its children joins (`workspace`, `ray_up`, `cli_env`) instead of
    starting its own. Its workers begin at niceness 0, as the runtime's embedded Ray starts
    them, so that their imports are not starved where something else runs."""
    import ray

    niceness = os.environ.get("RAY_worker_niceness", "0")
    hidden = {SHARED_RAY_ENV: None, SHARED_RAY_PID_ENV: None}  # not the one of a caller
    with _environ(**hidden, RAY_worker_niceness=niceness):  # read by the raylet
        _local_ray(temp_dir)
        try:
            address = ray.get_runtime_context().gcs_address
            with _environ(**{SHARED_RAY_ENV: address, SHARED_RAY_PID_ENV: str(os.getpid())}):
                yield
        finally:
            ray.shutdown()


def _local_ray(temp_dir: Path) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
        _temp_dir=str(temp_dir),
    )


def ray_up(temp_dir: Path) -> None:
    """A local Ray for a benchmark, its session files under ``temp_dir``; in smoke mode,
    a connection to the Ray its runs share (`shared_ray`) when there is one."""
    import ray

    address = shared_ray_address()
    if address is None:
        _local_ray(temp_dir)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)


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


def _ray_down() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


@contextmanager
def workspace(
    *, ray: bool = True, samples: int = SAMPLES, own_ray: bool = False
) -> Iterator[tuple[Path, Path]]:
    """(data set, scratch folder) for one benchmark; Ray started here when ``ray``.

    In smoke mode every run of the benchmark, in this process or launched from it, joins
    one Ray: the one `run_all.py --smoke` shares, or with ``own_ray`` one started here
    (``ray`` or not), for a benchmark that looks for its runs' processes under `ray_root`,
    where those of a benchmark beside it must not be.
    """
    import ray as ray_module

    from sft_runtime.runtime.data.demo import build_demo_dataset

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        with ExitStack() as stack:
            # any Ray started meanwhile (here, by a run, by an `sft-runtime train` child)
            # keeps its session files in there too, and they go with it: nothing in /tmp/ray
            stack.enter_context(_environ(RAY_TMPDIR=str(tmp / "ray")))
            if SMOKE and own_ray:
                stack.enter_context(shared_ray(tmp / "ray"))
            address = shared_ray_address()
            if address:  # a run in this process joins it too (`ensure_ray` reads this)
                stack.enter_context(_environ(RAY_ADDRESS=address))
            stack.callback(_ray_down)
            data = build_demo_dataset(tmp / "data", num_samples=samples, seed=0)
            if ray and not ray_module.is_initialized():
                ray_up(tmp / "ray")
            yield data, tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(run: Any, doc: str) -> None:
    """``python bench/<name>.py``: run one benchmark and print its table."""
    import argparse

    from bench.table import render

    argparse.ArgumentParser(description=doc.splitlines()[0]).parse_args()
    print(render(run()))

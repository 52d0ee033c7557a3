"""Fixtures shared across the suite (registered by tests/conftest.py).

Data sets and Ray are session-wide: a prepared energon set costs about 2 s, `ray.init`
3-7 s. Nothing here starts unless a test asks for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from sft_runtime.runtime.process.niceness import RAY_NICENESS_ENV
from tests.support import sources
from tests.support.reliability import (
    FSDP,
    STEPS,
    Reference,
    Runner,
    committed,
    load_weights,
    reap,
)

SCENARIO = Path(__file__).with_name("trace_scenario.py")
ROOT = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 240  # of `demo_dataset`, the data-path tests' own set


# ----------------------------------------------------------------------------- Ray
@pytest.fixture(scope="session", autouse=True)
def _ray_tmpdir():
    """Every Ray a test starts in a subprocess keeps its session files in one short temporary
    root (unix socket paths must stay short), removed at the end: the suite leaves no
    ``/tmp/ray/session_*`` behind."""
    root = tempfile.mkdtemp(prefix="sftray-")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root
    try:
        yield root
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_session():
    """Start one local Ray for the whole session (3-7 s), only when a test needs it."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # its workers start at the niceness runs use (Ray's 15 crawls on a busy machine); a run
    # that wants another value moves its own processes there (test_niceness.py)
    os.environ.setdefault(RAY_NICENESS_ENV, "0")
    # a short root of its own: Ray's unix socket paths must stay under 108 bytes, and pytest's
    # temporary folders grow with each worker's name
    temp_dir = tempfile.mkdtemp(prefix="sftray-session-")
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=str(temp_dir),
        logging_level="ERROR",
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- data sets
@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """A small prepared energon data set of synthetic chats (256 samples), built once."""
    from sft_runtime.runtime.data.demo import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("data") / "demo", num_samples=256, seed=0)


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> Path:
    """240 synthetic conversations for the data-path tests, prepared once (about 2 s)."""
    from sft_runtime.runtime.data.demo import build_demo_dataset

    root = tmp_path_factory.mktemp("data240")
    return build_demo_dataset(root / "demo", num_samples=NUM_SAMPLES)


def data_set_messages(data_set: Path) -> dict[str, list[dict[str, str]]]:
    """A prepared data set read straight from its tars: sample key -> messages (the ground
    truth the loaders are checked against)."""
    out: dict[str, list[dict[str, str]]] = {}
    for shard in sorted(data_set.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                if ext == "json":
                    out[key] = orjson.loads(tar.extractfile(member).read())["messages"]
    return out


@pytest.fixture(scope="session")
def demo_messages(demo_dataset) -> dict[str, list[dict[str, str]]]:
    """`demo_dataset`'s conversations by sample key."""
    out = data_set_messages(demo_dataset)
    assert len(out) == NUM_SAMPLES
    return out


_LOADER_FIELDS = {
    "batch_size": 4,
    "seed": 7,
    "shuffle_buffer_size": 16,
    "max_input_seq_length": 96,
    "pad_multiple": 8,
    "overlong_samples": "truncate",  # a third of the demo chats run past 96 tokens
}


@pytest.fixture
def make_loader(demo_dataset):
    """Factory for set-up loaders over `demo_dataset`; closes them all at the end."""
    from sft_runtime.runtime.data.config import LoaderSpec
    from sft_runtime.runtime.data.loader import ColocatedLoader

    loaders: list[ColocatedLoader] = []

    def factory(
        *, rank: int = 0, world: int = 1, state: dict | None = None, placement: str = "p", **kw
    ) -> ColocatedLoader:
        fields = {"data_path": str(demo_dataset), **_LOADER_FIELDS, "virtual_epoch_length": 6}
        fields.update(kw)
        loader = ColocatedLoader(LoaderSpec(**fields), rank, world, placement)
        loaders.append(loader)
        loader.setup(state)
        return loader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield factory
    for loader in loaders:
        loader.close()


@pytest.fixture
def perf_spec(demo_data):
    """LoaderSpec factory over `demo_data` (keyword overrides)."""
    from sft_runtime.runtime.data.config import LoaderSpec

    def make(**kw) -> Any:
        fields = {"data_path": str(demo_data), **_LOADER_FIELDS, "virtual_epoch_length": 5}
        fields.update(kw)
        return LoaderSpec(**fields)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield make


# ----------------------------------------------------------------------------- policy workers
@pytest.fixture(scope="session")
def policy_cfg():
    from sft_runtime.runtime.policy.config import ModelConfig, PolicyConfig

    return PolicyConfig(
        precision="float32",
        dtensor_cfg={"enabled": False},
        model=ModelConfig(
            vocab_size=sources.VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=sources.SEQ_LEN
        ),
        train_global_batch_size=2 * sources.ROWS_PER_RANK,
        train_micro_batch_size=2,
        max_grad_norm=1.0,
        optimizer={"kwargs": {"lr": 3e-3, "weight_decay": 0.01}},
        scheduler=[  # NeMo RL's shape: a warmup, then a cosine decay
            {
                "name": "torch.optim.lr_scheduler.LinearLR",
                "kwargs": {"start_factor": 1 / 3, "total_iters": 2},
            },
            {
                "name": "torch.optim.lr_scheduler.CosineAnnealingLR",
                "kwargs": {"T_max": 7, "eta_min": 1e-4},
            },
            {"milestones": [3]},
        ],
        make_sequence_length_divisible_by=8,
    )


@pytest.fixture(scope="session")
def cluster_cfg():
    from sft_runtime.runtime.policy.cluster_config import ClusterConfig

    return ClusterConfig(
        workers_per_node=2,
        cpus_per_worker=0.5,
        num_threads_per_worker=1,
        dist_timeout_s=30,
        call_timeout_s=60,
        placement_timeout_s=30,
    )


# ----------------------------------------------------------------------------- reliability
@pytest.fixture(scope="session")
def launch_env():
    """(short Ray root, session tag); every process a launch left is ended at the end."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="sftrel-"))  # unix socket paths must stay short
    tag = f"rel-{uuid.uuid4().hex[:10]}"
    try:
        yield ray_tmp, tag
    finally:
        reap(tag, grace_s=10)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture
def make_runner(tmp_path, demo_data, launch_env):
    ray_tmp, tag = launch_env

    def make(name: str = "run", steps: int = STEPS, overrides: tuple[str, ...] = ()) -> Runner:
        return Runner(
            tmp_path, demo_data, ray_tmp, tag, name=name, steps=steps, overrides=overrides
        )

    return make


@pytest.fixture(scope="session")
def reference(ray_session, demo_data, tmp_path_factory) -> Reference:
    """One uninterrupted run of the shared config, made in-process once per session."""
    return _reference(demo_data, tmp_path_factory.mktemp("reference") / "run")


@pytest.fixture(scope="session")
def fsdp_reference(ray_session, demo_data, tmp_path_factory) -> Reference:
    """The shared config sharded with FSDP2 (``FSDP``), uninterrupted, once per session."""
    return _reference(demo_data, tmp_path_factory.mktemp("fsdp-reference") / "run", *FSDP)


def _reference(demo_data: Path, run_dir: Path, *overrides: str) -> Reference:
    from sft_runtime.runtime.launch.driver import run_training
    from tests.support.small_run import small_config

    summary = run_training(small_config(run_dir, demo_data, STEPS, *overrides))
    assert summary["reason"] == "completed" and summary["total_steps"] == STEPS
    ref = Reference(run_dir, STEPS, committed(run_dir), load_weights(run_dir, STEPS))
    assert sorted(ref.committed) == list(range(1, STEPS + 1))
    return ref


# ----------------------------------------------------------------------------- traces
def _run_scenario(name: str, args: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """A scenario of trace_scenario.py in a fresh interpreter (OpenTelemetry's global
    providers can be set only once per process); returns its JSON result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), name, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def run_scenario() -> Callable[..., dict[str, Any]]:
    return _run_scenario


@pytest.fixture(scope="session")
def traced_run(tmp_path_factory) -> dict[str, Any]:
    """A run directory written by a 'controller' process and two 'worker' processes, merged."""
    run_dir = tmp_path_factory.mktemp("traced_run")
    return {"run_dir": run_dir, **_run_scenario("driver", {"run_dir": str(run_dir)}, timeout=120)}


# ----------------------------------------------------------------------------- Hugging Face
@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A hub-like folder: Llama-3-style tokenizer and template beside a two-layer
    ``LlamaForCausalLM`` (fp32), built offline once per session (about 1 s)."""
    pytest.importorskip("transformers")
    from tests.support.hf_models import hf_model_dir

    return hf_model_dir(tmp_path_factory.mktemp("hf") / "tiny-llama", family="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A hub-like folder: ChatML tokenizer and template (with generation markers) beside a
    two-layer ``Qwen2ForCausalLM`` (fp32), built offline once per session."""
    pytest.importorskip("transformers")
    from tests.support.hf_models import hf_model_dir

    return hf_model_dir(tmp_path_factory.mktemp("hf") / "tiny-qwen2", family="qwen2")


HF_STEPS = 5  # of `hf_reference`: checkpoints at 2, 4 and the final 5


def hf_overrides(folder: Path) -> tuple[str, ...]:
    """The small run's config on a Hugging Face model folder, packed as `examples/hf.yaml`
    is (so exact resume and FSDP are proven on the packed attention path)."""
    return (
        f"policy.model_name={folder}",
        "data.max_input_seq_length=128",
        "policy.sequence_packing.enabled=true",
        "policy.optimizer.kwargs.lr=1e-3",
        "checkpointing.save_period=2",
    )


@pytest.fixture(scope="session")
def hf_reference(ray_session, demo_data, tiny_llama, tmp_path_factory) -> Reference:
    """The tiny Llama fine-tuned on the demo chats, uninterrupted, unsharded, once."""
    from sft_runtime.runtime.launch.driver import run_training
    from tests.support.small_run import small_config

    run_dir = tmp_path_factory.mktemp("hf-reference") / "run"
    summary = run_training(small_config(run_dir, demo_data, HF_STEPS, *hf_overrides(tiny_llama)))
    assert summary["reason"] == "completed" and summary["total_steps"] == HF_STEPS
    return Reference(run_dir, HF_STEPS, committed(run_dir), load_weights(run_dir, HF_STEPS))


# ----------------------------------------------------------------------------- validation
VAL_SAMPLES = 21  # not a multiple of the batch: the last one is short, one rank's share too


@pytest.fixture(scope="session")
def val_data(tmp_path_factory) -> Path:
    """`demo_data`'s 256 training chats (the same samples, keys and shards) and a ``val``
    split of `VAL_SAMPLES` more."""
    from sft_runtime.runtime.data.demo import build_demo_dataset

    root = tmp_path_factory.mktemp("data-val")
    return build_demo_dataset(root / "demo", num_samples=256, seed=0, val_samples=VAL_SAMPLES)


def val_overrides(data: Path, *, period: int = 2) -> tuple[str, ...]:
    """Validation every ``period`` steps, at the start and at the end, over the whole split."""
    return (
        f"data.validation.path={data}",
        f"sft.val_period={period}",
        "sft.val_at_start=true",
        "sft.val_at_end=true",
        "sft.val_global_batch_size=8",
        "sft.val_micro_batch_size=2",
    )

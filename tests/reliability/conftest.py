"""Fixtures of the reliability tests: the data set, a short Ray root, the reference run."""

from __future__ import annotations

import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))  # small_run

from reliability_harness import (  # noqa: E402
    STEPS,
    Reference,
    Runner,
    committed,
    load_weights,
    reap,
)


@pytest.fixture(scope="session")
def reliability_data(tmp_path_factory) -> Path:
    from runtime.data.demo import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("data") / "demo", num_samples=256, seed=0)


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
def make_runner(tmp_path, reliability_data, launch_env):
    ray_tmp, tag = launch_env

    def make(name: str = "run", steps: int = STEPS, overrides: tuple[str, ...] = ()) -> Runner:
        return Runner(
            tmp_path, reliability_data, ray_tmp, tag, name=name, steps=steps, overrides=overrides
        )

    return make


@pytest.fixture(scope="session")
def reference(ray_session, reliability_data, tmp_path_factory) -> Reference:
    """One uninterrupted run of the shared config, made in-process once per session."""
    from small_run import small_config

    from runtime.driver import run_training

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    summary = run_training(small_config(run_dir, reliability_data, STEPS))
    assert summary["reason"] == "completed" and summary["total_steps"] == STEPS
    ref = Reference(run_dir, STEPS, committed(run_dir), load_weights(run_dir, STEPS))
    assert sorted(ref.committed) == list(range(1, STEPS + 1))
    return ref

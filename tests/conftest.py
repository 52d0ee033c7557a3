"""Session-wide fixtures: one embedded Ray instance shared by every test that asks for it."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """Start one local Ray for the whole session (3-7 s), only when a test needs it."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    temp_dir = tmp_path_factory.mktemp("ray")
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


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    """A small prepared energon data set of synthetic chats (256 samples), built once."""
    from runtime.data.demo import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("data") / "demo", num_samples=256, seed=0)

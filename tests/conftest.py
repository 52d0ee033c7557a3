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

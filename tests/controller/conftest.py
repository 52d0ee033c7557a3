"""A small prepared data set and a small config, shared by the controller tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    from runtime.data.demo import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("data") / "demo", num_samples=256, seed=0)

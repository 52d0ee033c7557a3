"""Fixtures of the prefetch tests: a small prepared data set and loader specs over it."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

from runtime.data.config import LoaderSpec

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def perf_data(tmp_path_factory) -> Path:
    from runtime.data.demo import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("perf") / "demo", num_samples=256, seed=0)


@pytest.fixture
def perf_spec(perf_data):
    """LoaderSpec factory over the data set (keyword overrides)."""

    def make(**kw) -> LoaderSpec:
        fields = {
            "data_path": str(perf_data),
            "batch_size": 4,
            "seed": 7,
            "shuffle_buffer_size": 16,
            "max_input_seq_length": 96,
            "pad_multiple": 8,
            "virtual_epoch_length": 5,
        }
        fields.update(kw)
        return LoaderSpec(**fields)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield make


@pytest.fixture(scope="session")
def small_run_module():
    """tests/controller/small_run.py, loaded under a name of its own."""
    name = "perf_small_run"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TESTS / "controller" / "small_run.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]

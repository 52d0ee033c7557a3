"""Fixtures of the data-path tests: one small real energon data set per session."""

from __future__ import annotations

import tarfile
import warnings
from pathlib import Path

import orjson
import pytest

from runtime.data.config import LoaderSpec
from runtime.data.demo import build_demo_dataset
from runtime.data.loader import ColocatedLoader

NUM_SAMPLES = 240


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> Path:
    """240 synthetic conversations, prepared once (about 2 s)."""
    return build_demo_dataset(tmp_path_factory.mktemp("data") / "demo", num_samples=NUM_SAMPLES)


@pytest.fixture(scope="session")
def demo_messages(demo_dataset) -> dict[str, list[dict[str, str]]]:
    """The data set read straight from its tars: sample key -> messages (the ground truth)."""
    out: dict[str, list[dict[str, str]]] = {}
    for shard in sorted(demo_dataset.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                if ext == "json":
                    out[key] = orjson.loads(tar.extractfile(member).read())["messages"]
    assert len(out) == NUM_SAMPLES
    return out


@pytest.fixture
def make_loader(demo_dataset):
    """Factory for set-up loaders over the demo data set; closes them all at the end."""
    loaders: list[ColocatedLoader] = []

    def factory(
        *, rank: int = 0, world: int = 1, state: dict | None = None, placement: str = "p", **kw
    ) -> ColocatedLoader:
        fields = {
            "data_path": str(demo_dataset),
            "batch_size": 4,
            "seed": 7,
            "shuffle_buffer_size": 16,
            "max_input_seq_length": 96,
            "pad_multiple": 8,
            "virtual_epoch_length": 6,
        }
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

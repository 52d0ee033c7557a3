"""Data config sections and the resolved LoaderSpec."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from sft_runtime.runtime.data.config import (
    DataConfig,
    SequencePackingConfig,
    build_loader_spec,
)
from sft_runtime.runtime.errors import UserInputError

SECTION = {
    "max_input_seq_length": 128,
    "train": {"path": "/data/chat", "virtual_epoch_length": 10},
    "energon": {"shuffle_buffer_size": 64},
}


def test_defaults_and_unknown_keys():
    data = DataConfig.model_validate(SECTION)
    assert data.backend == "energon" and data.train.split == "train"
    assert data.num_workers == 1  # NeMo RL's
    with pytest.raises(ValidationError, match="shuffle_bufer_size"):
        DataConfig.model_validate({**SECTION, "energon": {"shuffle_bufer_size": 64}})
    # no epoch length: one pass over the train split, counted once the data is at hand
    assert (
        DataConfig.model_validate({**SECTION, "train": {"path": "/x"}}).train.virtual_epoch_length
        is None
    )
    with pytest.raises(ValidationError, match="no source; give data_path"):
        DataConfig.model_validate({**SECTION, "train": {"virtual_epoch_length": 3}})


def test_spec_splits_the_global_batch_and_is_picklable():
    data = DataConfig.model_validate(SECTION)
    spec = build_loader_spec(data, global_batch_size=16, logical_world_size=4, seed=3)
    assert spec.batch_size == 4 and spec.seed == 3 and not spec.packing
    assert spec.shuffle_buffer_size == 64 and spec.virtual_epoch_length == 10
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(UserInputError, match="multiple of the data-parallel size"):
        build_loader_spec(data, global_batch_size=10, logical_world_size=4)


def test_packing_settings_resolve():
    data = DataConfig.model_validate(SECTION)
    packing = SequencePackingConfig(
        enabled=True, algorithm="greedy_knapsack", max_sequences_per_bin=3
    )
    spec = build_loader_spec(data, global_batch_size=8, logical_world_size=2, packing=packing)
    # the batch counts conversations, packed or not: 8 over 2 ranks is 4 a rank
    assert (spec.packing_algorithm, spec.batch_size, spec.max_sequences_per_bin) == (
        "greedy_knapsack",
        4,
        3,
    )
    with pytest.raises(ValidationError, match="there is no packing buffer; remove the key"):
        DataConfig.model_validate(
            {**SECTION, "energon": {"shuffle_buffer_size": 64, "packing_buffer_size": 50}}
        )
    with pytest.raises(ValidationError, match="algorithm"):
        SequencePackingConfig(enabled=True, algorithm="best_fit")

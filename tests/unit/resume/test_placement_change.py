"""What a resume on another number of workers may change: W within the shards, never G."""

from __future__ import annotations

from pathlib import Path

import pytest

from sft_runtime.runtime.config import check_shards
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.resume.config_keys import MISSING
from sft_runtime.runtime.resume.placement_change import check_placement, saved_shards

CKPT = Path("/run/checkpoints/step_4")


def _flat(nodes: int, workers: int, shards) -> dict:
    return {
        "cluster.num_nodes": nodes,
        "cluster.workers_per_node": workers,
        "data.elastic.shards": shards,
    }


def test_a_run_without_the_key_has_its_starting_workers_as_shards():
    assert saved_shards(_flat(2, 4, None)) == 8
    assert saved_shards(_flat(1, 2, MISSING)) == 2  # a config of an older release
    assert saved_shards(_flat(1, 2, 6)) == 6


@pytest.mark.parametrize(("nodes", "workers"), [(1, 1), (1, 2), (2, 2), (1, 4)])
def test_any_number_of_workers_dividing_the_shards_resumes(nodes, workers):
    old, new = _flat(1, 2, 4), _flat(nodes, workers, None)
    check_placement(CKPT, old, new)
    assert old["data.elastic.shards"] == new["data.elastic.shards"] == 4  # compared equal


def test_workers_that_do_not_divide_the_shards_are_refused_naming_both():
    with pytest.raises(UserInputError) as err:
        check_placement(CKPT, _flat(1, 2, None), _flat(1, 3, None))
    message = str(err.value)
    assert "3 data-parallel workers" in message
    assert "data.elastic.shards=2" in message
    assert "resume on 1, 2 workers" in message


def test_changed_shards_are_refused_naming_the_key():
    with pytest.raises(UserInputError, match=r"data.elastic.shards: 2 -> 4"):
        check_placement(CKPT, _flat(1, 2, None), _flat(1, 2, 4))


def test_the_config_refuses_shards_its_workers_or_micro_batches_do_not_fit():
    from types import SimpleNamespace

    policy = SimpleNamespace(train_global_batch_size=8, train_micro_batch_size=2)
    check_shards(None, 3, policy)
    check_shards(4, 2, policy)
    with pytest.raises(ValueError, match=r"data.elastic.shards=4: the 3 data-parallel"):
        check_shards(4, 3, policy)
    with pytest.raises(ValueError, match=r"multiple of data.elastic.shards=8 x"):
        check_shards(8, 2, policy)

"""Data shards re-dealt over any number of workers: the same samples, step by step and shard
by shard, as G loaders that never stopped.

A property test over random runs: G=4 shards, the run split at random steps into
segments, each on a random W that divides G (W workers, each a `ShardGroupLoader` of G/W
shards, or one `ColocatedLoader` when W = G, some reading ahead), restored from the previous
segment's per-shard states, with failed steps (a load that is aborted and loaded again) at
random.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

from sft_runtime.runtime.checkpoint.loader_states import dumps_loader_states, loads_loader_states
from sft_runtime.runtime.data.config import LoaderSpec
from sft_runtime.runtime.data.loader import ColocatedLoader
from sft_runtime.runtime.data.prefetch import PrefetchingLoader
from sft_runtime.runtime.data.shards import ShardGroupLoader, shard_states
from tests.support.fixtures import _LOADER_FIELDS

SHARDS = 4
STEPS = 10
PACKING = {"packing_algorithm": "first_fit_shuffle"}
TENSORS = ("input_ids", "loss_mask", "position_ids", "segment_ids")


def _spec(data_set, **extra) -> LoaderSpec:
    return LoaderSpec(
        data_path=str(data_set), **{**_LOADER_FIELDS, "virtual_epoch_length": 6, **extra}
    )


def _shard(spec: LoaderSpec, shard: int) -> ColocatedLoader:
    return ColocatedLoader(spec, shard, SHARDS, "elastic-test")


def _rows(batch, start: int, count: int) -> dict[str, torch.Tensor]:
    return {name: getattr(batch, name)[start : start + count] for name in TENSORS}


def _reference(spec: LoaderSpec) -> list[list[tuple[list[str], dict]]]:
    """shard -> step -> (source ids, tensors) of G loaders that run straight through."""
    out = []
    for shard in range(SHARDS):
        loader = _shard(spec, shard)
        loader.setup(None)
        steps = []
        for _ in range(STEPS):
            envelope = loader.load()
            batch = loader.active_batch
            steps.append((envelope.source_ids, _rows(batch, 0, batch.num_rows)))
            loader.commit()
        loader.close()
        out.append(steps)
    return out


def _worker_loader(spec: LoaderSpec, shards: list[int], prefetch: bool):
    if len(shards) == 1:
        make = partial(_shard, spec, shards[0])
    else:
        make = partial(ShardGroupLoader, [partial(_shard, spec, s) for s in shards])
    # read-ahead in the caller's thread (`fetch_now`): the workers of this test share one
    # process, where energon allows one loader at a time to iterate
    return PrefetchingLoader(make, 2, background=False) if prefetch else make()


def _check_step(envelope, batch, shards: list[int], step: int, reference) -> None:
    parts = envelope.per_shard()
    assert [p.logical_rank for p in parts] == shards
    row = 0
    for part, shard in zip(parts, shards, strict=True):
        ids, tensors = reference[shard][step]
        assert part.source_ids == ids, (shard, step)
        count = tensors["input_ids"].shape[0]
        mine = _rows(batch, row, count)
        width = tensors["input_ids"].shape[1]
        for name in TENSORS:  # the shard's own rows, then only padding to the widest shard
            assert torch.equal(mine[name][:, :width], tensors[name]), (shard, step, name)
        assert (mine["segment_ids"][:, width:] == -1).all()
        assert (mine["loss_mask"][:, width:] == 0).all()
        row += count
    assert row == batch.num_rows
    assert envelope.source_ids == [i for p in parts for i in p.source_ids]


@pytest.mark.parametrize("extra", [{}, PACKING], ids=["plain", "packed"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shards_re_dealt_on_any_divisor_deliver_the_reference_samples(demo_dataset, extra, seed):
    spec = _spec(demo_dataset, **extra)
    reference = _reference(spec)
    rng = random.Random(seed)
    states: list | None = None  # one per shard, as a checkpoint holds them
    step, worlds = 0, []
    while step < STEPS:
        world = rng.choice([1, 2, 4])
        stop = min(STEPS, step + rng.randint(1, 4))
        per = SHARDS // world
        dealt = [list(range(w * per, (w + 1) * per)) for w in range(world)]
        loaders = [_worker_loader(spec, shards, prefetch=rng.random() < 0.3) for shards in dealt]
        for loader, shards in zip(loaders, dealt, strict=True):
            mine = None if states is None else [states[s] for s in shards]
            loader.setup(mine if mine is None or len(mine) > 1 else mine[0])
        for at in range(step, stop):
            for loader, shards in zip(loaders, dealt, strict=True):
                if rng.random() < 0.25:  # a failed step: its batch goes back, then again
                    loader.load()
                    loader.abort()
                envelope = loader.load()
                _check_step(envelope, loader.active_batch, shards, at, reference)
            for loader in loaders:
                if isinstance(loader, PrefetchingLoader):
                    loader.fetch_now()  # the next batch, read while this one is in hand
                loader.commit()
        # the checkpoint: one state per shard, through the file format
        blobs = [s for loader in loaders for s in shard_states(loader.state_dict())]
        states = loads_loader_states(dumps_loader_states(blobs))
        for loader in loaders:
            loader.close()
        worlds.append(world)
        step = stop
    assert len(states) == SHARDS
    assert [s["committed_steps"] for s in states] == [STEPS] * SHARDS
    print(f"worlds {worlds}")


def test_a_group_restores_only_from_one_state_per_shard(demo_dataset):
    spec = _spec(demo_dataset)
    group = ShardGroupLoader([partial(_shard, spec, s) for s in (0, 1)])
    with pytest.raises(ValueError, match="one state per shard"):
        group.setup([{}])
    group.close()

"""The colocated loader against a real energon data set: resume, abort, DP split, errors."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.checkpoint.loader_states import dumps_loader_states, loads_loader_states
from sft_runtime.runtime.data.loader import LoaderStateMismatchError

PACKING = {"packing_algorithm": "first_fit_shuffle"}


def _take(loader, steps: int) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
    out = []
    for _ in range(steps):
        envelope = loader.load()
        batch = loader.active_batch
        assert envelope.source_ids == batch.source_ids
        tensors = {
            name: getattr(batch, name).clone()
            for name in ("input_ids", "loss_mask", "position_ids", "segment_ids")
        }
        out.append((envelope.source_ids, tensors))
        loader.commit()
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for (ids_a, t_a), (ids_b, t_b) in zip(a, b, strict=True):
        assert ids_a == ids_b
        for name in t_a:
            assert torch.equal(t_a[name], t_b[name]), name


@pytest.mark.parametrize("extra", [{}, PACKING], ids=["plain", "packed"])
def test_resume_from_state_is_exact(make_loader, extra):
    straight = _take(make_loader(**extra), 20)
    first = make_loader(**extra)
    head = _take(first, 7)
    blob = dumps_loader_states([first.state_dict()])
    first.close()
    resumed = make_loader(state=loads_loader_states(blob)[0], **extra)
    tail = _take(resumed, 13)
    _assert_same(straight, head + tail)
    # 20 steps cross three virtual epochs of 6: rollover keeps going, never repeats early.
    assert straight[6][0] != straight[0][0]


@pytest.mark.parametrize("extra", [{}, PACKING], ids=["plain", "packed"])
def test_abort_rewinds_to_the_same_samples(make_loader, extra):
    reference = _take(make_loader(**extra), 6)
    loader = make_loader(**extra)
    committed = _take(loader, 2)
    first = loader.load()
    loader.abort()
    again = loader.load()
    loader.abort()
    assert again.source_ids == first.source_ids == reference[2][0]
    committed += _take(loader, 4)
    _assert_same(reference, committed)


def test_abort_without_batch_is_a_no_op_and_envelope_is_metadata(make_loader):
    loader = make_loader()
    loader.abort()
    envelope = loader.load()
    batch = loader.active_batch
    assert envelope.physical_packs == batch.num_rows == 4
    assert envelope.valid_tokens == int(batch.loss_mask.sum()) > 0
    assert envelope.sequence_lengths == batch.sequence_lengths
    assert all(isinstance(s, str) and s.startswith("line") for s in envelope.source_ids)
    assert (envelope.logical_rank, envelope.logical_world_size) == (0, 1)
    assert batch.input_ids.shape[1] % 8 == 0


def test_protocol_errors(make_loader):
    loader = make_loader()
    with pytest.raises(RuntimeError, match="no active batch"):
        loader.commit()
    loader.load()
    with pytest.raises(RuntimeError, match="already active"):
        loader.load()
    with pytest.raises(RuntimeError, match="while a batch is active"):
        loader.state_dict()
    loader.commit()
    loader.close()
    with pytest.raises(RuntimeError, match="not set up"):
        loader.load()


@pytest.mark.parametrize("world", [2, 4])
def test_dp_ranks_split_the_data_set_each_epoch(make_loader, demo_messages, world):
    per_rank_steps = len(demo_messages) // world // 4
    seen = [[] for _ in range(2)]
    for rank in range(world):
        loader = make_loader(
            rank=rank,
            world=world,
            max_input_seq_length=512,
            virtual_epoch_length=per_rank_steps,
            shuffle_buffer_size=None,  # a shuffle buffer blurs the epoch boundary by design
        )
        for epoch in range(2):
            keys = [k for ids, _ in _take(loader, per_rank_steps) for k in ids]
            seen[epoch].append(keys)
        loader.close()
    for epoch_keys in seen:
        flat = [k for keys in epoch_keys for k in keys]
        assert len(flat) == len(set(flat)), "a sample went to two ranks (or twice to one)"
        assert set(flat) == set(demo_messages)


def test_fingerprint_mismatch_names_every_change(make_loader):
    loader = make_loader()
    _take(loader, 1)
    state = loader.state_dict()
    with pytest.raises(LoaderStateMismatchError) as info:
        make_loader(state=state, batch_size=8, seed=8, placement="other", **PACKING)
    message = str(info.value)
    for expected in (
        "batch_size: 4 -> 8",
        "seed: 7 -> 8",
        "placement_hash: 'p' -> 'other'",
        "packing_algorithm: None -> 'first_fit_shuffle'",
    ):
        assert expected in message
    with pytest.raises(LoaderStateMismatchError, match="logical_rank: 0 -> 1"):
        make_loader(state=state, rank=1, world=2)
    with pytest.raises(LoaderStateMismatchError, match="logical_world_size: 1 -> 2"):
        make_loader(state=state, rank=0, world=2)


def test_setup_rejects_unprepared_path(make_loader, tmp_path):
    with pytest.raises(Exception, match="not a prepared energon data set"):
        make_loader(data_path=str(tmp_path))


def test_two_workers_resume_and_double_abort_are_exact(make_loader):
    workers = {"num_workers": 2, "shuffle_buffer_size": 8}
    straight = _take(make_loader(**workers), 8)
    loader = make_loader(**workers)
    got = _take(loader, 3)
    for _ in range(2):
        envelope = loader.load()
        assert envelope.source_ids == straight[3][0]
        loader.abort()
    state = loader.state_dict()
    loader.close()
    got += _take(make_loader(state=state, **workers), 5)
    _assert_same(straight, got)


def test_a_worker_process_hands_over_the_same_batches_without_shared_memory(make_loader):
    inline = _take(make_loader(), 4)
    loader = make_loader(num_workers=1)
    loader.load()
    # sent as bytes (runtime.data.batch), not as shared-memory file descriptors
    assert not loader.active_batch.input_ids.is_shared()
    loader.abort()
    _assert_same(inline, _take(loader, 4))


def test_epochs_are_counted_in_committed_steps_and_survive_resume(make_loader):
    loader = make_loader(virtual_epoch_length=3)
    epochs = []
    for _ in range(4):
        epochs.append(loader.load().extra["epoch"])
        loader.commit()
    assert epochs == [0, 0, 0, 1]
    state = loader.state_dict()
    assert state["committed_steps"] == 4 and state["committed_samples"] == 16
    resumed = make_loader(virtual_epoch_length=3, state=state)
    assert [resumed.load().extra["epoch"]] == [1]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("workers", [0, 2])
def test_close_releases_files_threads_and_processes(make_loader, workers):
    def open_shards() -> int:
        targets = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
        return sum(".tar" in t for t in targets)

    before = set(threading.enumerate())
    loader = make_loader(num_workers=workers)
    for _ in range(3):
        loader.load()
        loader.abort()
    loader.load()
    loader.commit()
    assert workers == 0 or multiprocessing.active_children()
    loader.close()
    assert open_shards() == 0

    # only threads this loader started count: Ray (when a test of this session started it)
    # keeps its own threads coming and going
    def leaked() -> list[threading.Thread]:
        return [
            t for t in threading.enumerate() if t not in before and not t.name.startswith("ray")
        ]

    deadline = time.monotonic() + 120  # queue feeder threads finish just after their queue closes
    while leaked() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leaked() == [], [t.name for t in leaked()]
    assert multiprocessing.active_children() == []


def test_a_state_taken_before_every_worker_delivered_resumes_exactly(make_loader):
    """With two worker processes the state after the first batch names a worker that has
    delivered nothing yet; energon, asked too early, put that worker one batch ahead in about
    one try of three, so the resume skipped a batch. Eight tries: all must resume exactly."""
    for _ in range(8):
        loader = make_loader(num_workers=2)
        loader.load()
        loader.commit()
        state = loader.state_dict()
        expected = loader.load().source_ids
        loader.close()
        resumed = make_loader(num_workers=2, state=state)
        assert resumed.load().source_ids == expected
        resumed.close()

"""`PrefetchingLoader` on real energon: the committed stream, aborts and saved states are
exactly those of the plain `ColocatedLoader`, whatever the read-ahead did meanwhile."""

from __future__ import annotations

import copy
import threading
import time
from functools import partial

import pytest
import torch

from sft_runtime.runtime.data.loader import ColocatedLoader
from sft_runtime.runtime.data.prefetch import ENERGON_LOCK, PrefetchingLoader

TENSORS = ("input_ids", "loss_mask", "position_ids", "segment_ids")


class _Plain(ColocatedLoader):
    """The plain loader, holding `ENERGON_LOCK` (energon is process-global while iterating,
    and read-ahead threads of other loaders run in this test process)."""

    def setup(self, restored_state=None):
        with ENERGON_LOCK:
            super().setup(restored_state)

    def load(self):
        with ENERGON_LOCK:
            return super().load()

    def state_dict(self):
        with ENERGON_LOCK:
            return super().state_dict()

    def close(self):
        with ENERGON_LOCK:
            super().close()


def _plain(spec, state=None, rank=0, world=1) -> ColocatedLoader:
    loader = _Plain(spec, rank, world, "p")
    loader.setup(state)
    return loader


def _prefetching(spec, depth, state=None, rank=0, world=1) -> PrefetchingLoader:
    loader = PrefetchingLoader(partial(ColocatedLoader, spec, rank, world, "p"), depth)
    loader.setup(state)
    return loader


def _take(loader, n: int, commit: bool = True) -> list[dict]:
    """Load (and commit) n batches; what each delivered, tensors cloned."""
    out = []
    for _ in range(n):
        env = loader.load()
        batch = loader.active_batch
        out.append(
            {
                "source_ids": list(env.source_ids),
                "extra": dict(env.extra),
                "valid_tokens": env.valid_tokens,
                "lengths": list(env.sequence_lengths),
                "cu_seqlens": batch.cu_seqlens,
                **{k: getattr(batch, k).clone() for k in TENSORS},
            }
        )
        if commit:
            loader.commit()
    return out


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in x:
            if key in TENSORS:
                assert torch.equal(x[key], y[key]), f"batch {i}: {key} differs"
            else:
                assert x[key] == y[key], f"batch {i}: {key} differs"


def _wait_full(loader: PrefetchingLoader) -> None:
    """Until the read-ahead holds `depth` batches and no fetch is in flight (a fetch counts
    in `held()` from the moment it starts, before energon moves). No timing claim, only a
    bounded wait."""
    deadline = time.monotonic() + 60
    while True:
        with loader._cond:
            if not loader._busy and loader.held() >= loader.depth:
                return
        assert time.monotonic() < deadline, "read-ahead never filled"
        time.sleep(0.005)


@pytest.mark.parametrize("depth", [2, 4])
def test_committed_stream_is_identical(perf_spec, depth):
    spec = perf_spec()
    plain = _plain(spec)
    ahead = _prefetching(spec, depth)
    try:
        _same(_take(ahead, 12), _take(plain, 12))  # crosses two virtual epochs
        assert plain.state_dict()["committed_samples"] == ahead.state_dict()["committed_samples"]
    finally:
        plain.close()
        ahead.close()


def test_stream_identical_with_packing_and_two_ranks(perf_spec):
    spec = perf_spec(
        batch_size=3,
        max_input_seq_length=128,
        packing_algorithm="first_fit_decreasing",
    )
    for rank in (0, 1):
        plain, ahead = _plain(spec, rank=rank, world=2), _prefetching(spec, 3, rank=rank, world=2)
        try:
            _same(_take(ahead, 6), _take(plain, 6))
        finally:
            plain.close()
            ahead.close()


def test_abort_redelivers_the_active_and_the_prefetched_batches(perf_spec):
    spec = perf_spec()
    reference = _take(_plain(spec), 10)
    ahead = _prefetching(spec, 3)
    try:
        got = _take(ahead, 2)
        ahead.load()  # batch 2 active
        _wait_full(ahead)  # batches 3 and 4 read ahead
        ahead.abort()
        ahead.abort()  # no active batch: nothing to do
        got += _take(ahead, 1, commit=False)  # batch 2 again, not committed
        _wait_full(ahead)
        ahead.abort()  # twice in a row
        got = got[:2] + _take(ahead, 4)  # batches 2..5
        _wait_full(ahead)
        _same(got, reference[:6])
        ahead.abort()  # nothing active: the read-ahead stays valid
        _same(_take(ahead, 4), reference[6:10])
    finally:
        ahead.close()


@pytest.mark.parametrize("k", [0, 3, 5])
def test_state_dict_ignores_read_ahead(perf_spec, k):
    spec = perf_spec()
    reference = _take(_plain(spec), k + 4)
    plain, ahead = _plain(spec), _prefetching(spec, 3)
    try:
        _take(plain, k)
        _take(ahead, k)
        _wait_full(ahead)
        saved, expected = ahead.state_dict(), plain.state_dict()
        assert saved["committed_steps"] == expected["committed_steps"] == k
        assert saved["committed_samples"] == expected["committed_samples"]
        assert saved["fingerprint"] == expected["fingerprint"]
        # energon's restore mutates the state it is given: one copy per restore
        for fresh in (_plain(spec, copy.deepcopy(saved)), _prefetching(spec, 2, saved)):
            try:
                _same(_take(fresh, 4), reference[k:])
            finally:
                fresh.close()
        # neither saving nor restoring the saved state in this process disturbed the read-ahead
        _same(_take(ahead, 1, commit=False), reference[k : k + 1])
        ahead.abort()
        _same(_take(ahead, 4), reference[k:])
    finally:
        plain.close()
        ahead.close()


def test_state_dict_refused_while_active_and_load_twice_refused(perf_spec):
    ahead = _prefetching(perf_spec(), 2)
    try:
        ahead.load()
        with pytest.raises(RuntimeError, match="active"):
            ahead.state_dict()
        with pytest.raises(RuntimeError, match="already active"):
            ahead.load()
        ahead.commit()
        with pytest.raises(RuntimeError, match="no active batch"):
            ahead.commit()
    finally:
        ahead.close()
    ahead.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        ahead.load()


def test_prefetch_leaves_torch_settings_alone(perf_spec):
    before = (torch.get_num_threads(), torch.is_grad_enabled())
    ahead = _prefetching(perf_spec(), 3)
    try:
        _take(ahead, 3)
        _wait_full(ahead)
        assert (torch.get_num_threads(), torch.is_grad_enabled()) == before
    finally:
        ahead.close()


# -- thread discipline and errors, with a scripted inner loader -----------------------------


class _ScriptedInner:
    """Batches are integers; records whether two threads were ever inside 'energon' at once."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.position = 0  # the 'energon' position: index of the next batch
        self.fail_at = fail_at
        self.inside = 0
        self.overlaps = 0
        self.guard = threading.Lock()
        self.active = None
        self.committed = 0

    def _enter(self) -> None:
        with self.guard:
            self.inside += 1
            self.overlaps += self.inside > 1
        time.sleep(0.001)

    def _leave(self) -> None:
        with self.guard:
            self.inside -= 1

    def setup(self, restored_state=None) -> None:
        self.position = 0 if restored_state is None else restored_state["position"]

    def fetch_ahead(self):
        self._enter()
        try:
            index = self.position
            if index == self.fail_at:
                self.fail_at = None
                raise ValueError(f"bad sample at {index}")
            self.position += 1
            return index, index
        finally:
            self._leave()

    def activate_fetched(self, state_before, batch, load_seconds):
        assert self.active is None
        self.active = (state_before, batch)
        return batch

    @property
    def active_batch(self):
        if self.active is None:
            raise RuntimeError("no active batch")
        return self.active[1]

    def commit(self) -> None:
        self.active_batch  # noqa: B018 - raises without one
        self.active, self.committed = None, self.committed + 1

    def abort(self) -> None:
        self._enter()
        try:
            if self.active is not None:
                self.position, self.active = self.active[0], None
        finally:
            self._leave()

    def state_dict(self) -> dict:
        self._enter()
        try:
            return {"position": self.position, "committed": self.committed}
        finally:
            self._leave()

    def state_dict_at(self, state) -> dict:
        return {"position": state, "committed": self.committed}

    def close(self) -> None:
        pass


def test_energon_is_never_entered_by_two_threads():
    inner = _ScriptedInner()
    ahead = PrefetchingLoader(lambda: inner, 3)
    ahead.setup()
    delivered = []
    try:
        for i in range(200):
            delivered.append(ahead.load())
            if i % 7 == 3:
                ahead.abort()
                delivered.pop()
                continue
            ahead.commit()
            if i % 5 == 0:
                assert ahead.state_dict()["position"] == len(delivered)
    finally:
        ahead.close()
    assert delivered == list(range(len(delivered)))
    assert inner.overlaps == 0


def test_a_failed_fetch_is_raised_in_stream_order():
    inner = _ScriptedInner(fail_at=2)
    ahead = PrefetchingLoader(lambda: inner, 4)
    ahead.setup()
    try:
        assert [ahead.load(), ahead.commit(), ahead.load(), ahead.commit()] == [0, None, 1, None]
        _fails_then_retries(ahead, 2)
    finally:
        ahead.close()


def _fails_then_retries(loader: PrefetchingLoader, index: int) -> None:
    """The next load raises the failed fetch of batch ``index``; after the controller's
    cleanup (an abort with nothing active) the load after it tries that batch again, as the
    plain loader's would."""
    with pytest.raises(ValueError, match=f"bad sample at {index}"):
        loader.load()
    loader.abort()
    assert loader.load() == index


def test_depth_bounds_the_batches_held():
    inner = _ScriptedInner()
    ahead = PrefetchingLoader(lambda: inner, 2)
    ahead.setup()
    try:
        _wait_full(ahead)
        time.sleep(0.05)
        assert inner.position == 2  # two read ahead, no more
        ahead.load()
        time.sleep(0.05)
        assert inner.position == 2 and ahead.held() == 2  # active + one ahead
        ahead.commit()
        _wait_full(ahead)
        assert inner.position == 3
    finally:
        ahead.close()


class _GatedInner(_ScriptedInner):
    """Its fetch of batch `gate_at` waits until the test opens the gate."""

    def __init__(self, gate_at: int) -> None:
        super().__init__()
        self.gate_at = gate_at
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def fetch_ahead(self):
        if self.position == self.gate_at:
            self.waiting.set()
            self.gate.wait()
        return super().fetch_ahead()


def test_a_checkpoint_does_not_wait_for_the_batch_being_read_behind_a_queued_one():
    inner = _GatedInner(gate_at=2)
    ahead = PrefetchingLoader(lambda: inner, 3)
    ahead.setup()
    saved: list[dict] = []
    try:
        assert ahead.load() == 0
        ahead.commit()
        inner.waiting.wait()  # batch 1 is queued, the fetch of batch 2 hangs at the gate
        saver = threading.Thread(target=lambda: saved.append(ahead.state_dict()))
        saver.start()
        saver.join(timeout=60)  # returns at once; a wait for the gated fetch would not
        blocked = saver.is_alive()
        inner.gate.set()
        saver.join()
        assert not blocked, "state_dict waited for the fetch in flight"
        assert saved == [{"position": 1, "committed": 1}]
        assert [ahead.load(), ahead.commit(), ahead.load()] == [1, None, 2]
    finally:
        inner.gate.set()
        ahead.close()

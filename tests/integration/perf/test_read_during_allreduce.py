"""`PrefetchingLoader` without a thread (``background=False``): the worker reads the next batch
while its gradients are all-reduced (`fetch_now`), and the committed stream, aborts and saved
states are still exactly those of the plain `ColocatedLoader`."""

from __future__ import annotations

import copy
import threading
from functools import partial

import pytest

from sft_runtime.runtime.data.loader import ColocatedLoader
from sft_runtime.runtime.data.prefetch import PrefetchingLoader
from tests.integration.perf.test_prefetch_exact import (
    _fails_then_retries,
    _plain,
    _same,
    _ScriptedInner,
    _take,
)


def _in_caller(spec, state=None) -> PrefetchingLoader:
    loader = PrefetchingLoader(partial(ColocatedLoader, spec, 0, 1, "p"), 2, background=False)
    loader.setup(state)
    return loader


def _steps(loader: PrefetchingLoader, n: int) -> list[dict]:
    """n steps as a worker runs them: load, then (in `finish`) read the next batch, commit."""
    out = []
    for _ in range(n):
        out += _take(loader, 1, commit=False)
        loader.fetch_now()
        loader.fetch_now()  # a second call finds no room: one batch ahead at most
        loader.commit()
    return out


def test_the_stream_is_the_plain_one_and_starts_no_thread(perf_spec):
    spec = perf_spec()
    reference = _take(_plain(spec), 12)
    threads = threading.active_count()
    loader = _in_caller(spec)
    try:
        assert threading.active_count() == threads
        _same(_steps(loader, 12), reference)  # crosses two virtual epochs
        assert loader.held() == 1  # the next batch, read ahead
    finally:
        loader.close()


@pytest.mark.parametrize("k", [1, 4])
def test_a_saved_state_ignores_the_batch_read_ahead(perf_spec, k):
    spec = perf_spec()
    reference = _take(_plain(spec), k + 3)
    loader = _in_caller(spec)
    try:
        _steps(loader, k)
        saved = loader.state_dict()
        assert saved["committed_steps"] == k
        for fresh in (_plain(spec, copy.deepcopy(saved)), _in_caller(spec, saved)):
            try:
                _same(_take(fresh, 3), reference[k:])
            finally:
                fresh.close()
        _same(_steps(loader, 3), reference[k:])  # the batch read ahead comes next
    finally:
        loader.close()


def test_an_abort_redelivers_the_active_and_the_read_ahead_batch(perf_spec):
    spec = perf_spec()
    reference = _take(_plain(spec), 6)
    loader = _in_caller(spec)
    try:
        got = _steps(loader, 2)
        loader.load()  # batch 2 active, batch 3 read ahead in its finish
        loader.fetch_now()
        loader.abort()
        got += _steps(loader, 4)
        _same(got, reference)
    finally:
        loader.close()


def test_a_load_with_nothing_read_ahead_fetches_in_place():
    inner = _ScriptedInner()
    loader = PrefetchingLoader(lambda: inner, 2, background=False)
    loader.setup()
    try:
        assert inner.position == 0  # nothing is read before it is asked for
        assert loader.load() == 0 and inner.position == 1
        loader.commit()
        assert loader.load() == 1 and inner.position == 2
        loader.fetch_now()
        assert inner.position == 3 and loader.held() == 2
        loader.commit()
        assert loader.load() == 2 and inner.position == 3  # taken from the read-ahead
    finally:
        loader.close()
    loader.fetch_now()  # after close: nothing to read into
    assert inner.position == 3


def test_a_failed_read_ahead_is_raised_by_the_next_load():
    inner = _ScriptedInner(fail_at=1)
    loader = PrefetchingLoader(lambda: inner, 2, background=False)
    loader.setup()
    try:
        assert loader.load() == 0
        loader.fetch_now()  # fails; the step it runs in is not disturbed
        loader.commit()
        _fails_then_retries(loader, 1)
    finally:
        loader.close()

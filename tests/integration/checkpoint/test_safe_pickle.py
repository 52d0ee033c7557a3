"""Loader states go through an allow-list unpickler: real states load, crafted ones do not."""

from __future__ import annotations

import pickle

import pytest

from sft_runtime.runtime.checkpoint.loader_states import (
    UnsafePickleError,
    dumps_loader_states,
    loads_loader_states,
    safe_loads,
)


class _Boom:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("workers", [0, 2])
def test_real_states_round_trip_and_still_resume(make_loader, workers):
    extra = {"packing_algorithm": "first_fit_shuffle"}
    extra["num_workers"] = workers
    loader = make_loader(**extra)
    loader.load()
    loader.commit()
    state = loader.state_dict()
    expected = loader.load().source_ids
    restored = loads_loader_states(dumps_loader_states([state]))[0]
    assert restored["fingerprint"] == state["fingerprint"]
    assert make_loader(state=restored, **extra).load().source_ids == expected


def test_crafted_pickle_is_refused_and_names_the_global():
    crafted = pickle.dumps({"format": "sft_v2_loader_states", "version": 1, "states": [_Boom()]})
    with pytest.raises(UnsafePickleError, match=r"posix\.system|os\.system"):
        loads_loader_states(crafted)


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(__import__("collections").Counter("ab")),
        pickle.dumps(pickle.Unpickler),
    ],
)
def test_other_globals_are_refused(payload):
    with pytest.raises(UnsafePickleError, match="refusing to unpickle global"):
        safe_loads(payload)


def test_wrong_or_damaged_files_are_clear_errors():
    with pytest.raises(UnsafePickleError, match="format marker"):
        loads_loader_states(pickle.dumps([1, 2]))
    with pytest.raises(UnsafePickleError, match="cannot read"):
        loads_loader_states(dumps_loader_states([{"a": 1}])[:-5])

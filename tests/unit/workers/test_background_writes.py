"""`BackgroundWrites`: the writer thread and the wait that may come before the hand-over.

The two sides are two calls of the worker actor served by different threads, so either can
come first; the waits here are on events the writes set, never on time.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.workers.background_writes import BackgroundWrites, Copies, Staging


def _write(path: Path, text: str):
    def write() -> list[str]:
        path.write_text(text)
        return [str(path)]

    return write


def test_the_files_of_every_write_come_back_with_the_result(tmp_path):
    writes = BackgroundWrites()
    writes.submit("a", [_write(tmp_path / "w", "x"), _write(tmp_path / "o", "y")], {"rank": 0})
    assert writes.wait("a") == {"rank": 0, "files": [str(tmp_path / "w"), str(tmp_path / "o")]}
    assert (tmp_path / "w").read_text() == "x" and (tmp_path / "o").read_text() == "y"


def test_a_wait_that_comes_first_gets_the_result_of_the_later_hand_over(tmp_path):
    writes = BackgroundWrites()
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(writes.wait("late")))
    waiter.start()
    writes.submit("other", [], {"rank": 9})  # another key does not wake it with a wrong result
    writes.submit("late", [_write(tmp_path / "f", "z")], {"rank": 1})
    waiter.join()
    assert got == {"rank": 1, "files": [str(tmp_path / "f")]}
    assert writes.wait("other") == {"rank": 9, "files": []}


def test_a_write_that_fails_raises_in_the_wait_and_the_next_one_still_runs(tmp_path):
    writes = BackgroundWrites()
    writes.submit("bad", [_write(tmp_path / "missing" / "f", "x")], {})
    writes.submit("good", [_write(tmp_path / "g", "y")], {})
    with pytest.raises(FileNotFoundError):
        writes.wait("bad")
    assert writes.wait("good")["files"] == [str(tmp_path / "g")]


def test_a_hand_over_that_failed_is_reported_by_the_wait():
    writes = BackgroundWrites()
    writes.failed("k", RuntimeError("cannot save while a train step is open"))
    with pytest.raises(RuntimeError, match="train step is open"):
        writes.wait("k")


def test_writes_run_one_after_another_in_the_order_handed_over(tmp_path):
    writes, order = BackgroundWrites(), []
    gate = threading.Event()

    def first() -> list[str]:
        gate.wait()
        order.append("first")
        return []

    def second() -> list[str]:
        order.append("second")
        return []

    writes.submit("1", [first], {})
    writes.submit("2", [second], {})
    gate.set()
    writes.wait("2")
    assert order == ["first", "second"]


def test_a_change_waits_for_the_copy_and_the_files_hold_the_values_before_it(tmp_path):
    """The copy runs in the writer thread; `wait_copied` (what the optimizer step calls
    first) returns only once it has, so a value changed afterwards is not what is written."""
    writes, copies = BackgroundWrites(), Copies()
    live = {"w": torch.tensor([1.0])}
    gate, copied = threading.Event(), threading.Event()

    def read() -> dict:
        gate.wait()
        return live

    value = copies.add("weights", read)
    writes.submit("k", [lambda: [_record(tmp_path / "f", value()["w"].tolist())]], {}, copies.take)
    changer = threading.Thread(target=lambda: (writes.wait_copied(), copied.set()))
    changer.start()
    try:  # the copy has not run, so the change must not come: however long it is given
        assert not copied.wait(0.1)
    finally:
        gate.set()
    changer.join()
    live["w"].add_(1)  # the change, in place as an optimizer step makes it, after the wait
    assert writes.wait("k")["files"] == [str(tmp_path / "f")]
    assert (tmp_path / "f").read_text() == "[1.0]"


def test_a_copy_that_fails_fails_its_checkpoint_and_releases_the_step(tmp_path):
    writes, copies = BackgroundWrites(), Copies()

    def read():
        raise MemoryError("no room for the copy")

    value = copies.add("weights", read)
    writes.submit("k", [lambda: [_record(tmp_path / "f", value())]], {}, copies.take)
    writes.wait_copied()  # returns: the step goes on
    with pytest.raises(MemoryError, match="no room"):
        writes.wait("k")
    assert not (tmp_path / "f").exists()


def test_without_take_each_write_reads_its_value_when_it_runs():
    """The synchronous save: nothing is copied ahead, a write reads the live value."""
    copies, live = Copies(), {"w": 1}
    value = copies.add("weights", lambda: dict(live))
    live["w"] = 2
    assert value() == {"w": 2}
    assert not Copies() and copies


def _record(path: Path, value) -> str:
    path.write_text(repr(value))
    return str(path)


def test_staging_copies_into_the_same_buffers_checkpoint_after_checkpoint():
    """The second checkpoint's copy lands in the first one's buffers (no fresh memory), holds
    the values at its own time, and keeps the nesting and the values that are not tensors."""
    staging = Staging()
    live = {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)}}, "lr": [0.1]}
    first = staging.copy("optimizer", live)
    pointer = first["state"][0]["exp_avg"].data_ptr()
    assert pointer != live["state"][0]["exp_avg"].data_ptr()
    live["state"][0]["exp_avg"].add_(2)
    assert first["state"][0]["exp_avg"].tolist() == [0.0, 0.0, 0.0]  # a copy, not a view
    second = staging.copy("optimizer", live)
    assert second["state"][0]["exp_avg"].data_ptr() == pointer
    assert second["state"][0]["exp_avg"].tolist() == [2.0, 2.0, 2.0]
    assert second["lr"] == [0.1] and second["state"][0]["step"].item() == 1.0


def test_staging_makes_a_new_buffer_for_a_new_shape_and_drops_what_is_gone():
    staging = Staging()
    first = staging.copy("weights", {"a": torch.ones(2), "b": torch.ones(4)})
    other = staging.copy("optimizer", {"a": torch.ones(2)})
    second = staging.copy("weights", {"a": torch.ones(3, dtype=torch.float64)})
    assert second["a"].shape == (3,) and second["a"].dtype == torch.float64
    assert second["a"].data_ptr() != first["a"].data_ptr()
    again = staging.copy("weights", {"a": torch.ones(3, dtype=torch.float64), "b": torch.ones(4)})
    assert again["b"].data_ptr() != first["b"].data_ptr()  # "b" was dropped in between
    assert staging.copy("optimizer", {"a": torch.ones(2)})["a"].data_ptr() == other["a"].data_ptr()

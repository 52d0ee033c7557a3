"""What the workers' flush leaves of the telemetry shutdown bound.

The processes of a run flush one after another on one bound, so a dead collector costs the
run the bound once. Only the flushes may spend it: the rest of the close (the metrics, the
machine, the log; slow on a busy machine) must leave the controller and the driver their
share, or they lose their spans, the driver's job root among them.
"""

from __future__ import annotations

import pytest

from sft_runtime.runtime.controller import attempt

BOUND_S = 2.0


class _Clock:
    """``time.time`` for `end_attempt`: it moves only when a fake component says so."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


class _Workers:
    def __init__(self, clock: _Clock, flush_s: float | None) -> None:
        self.clock, self.flush_s = clock, flush_s
        self.deadlines: list[float] = []

    def flush_telemetry(self, *, deadline: float, carrier: dict | None) -> list[bool]:
        self.deadlines.append(deadline)
        if self.flush_s is None:
            raise RuntimeError("the actors are gone")
        self.clock.now += self.flush_s
        return [self.clock.now <= deadline]


class _SlowMetrics:
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def close(self, reason: str) -> None:
        self.clock.now += 10 * BOUND_S  # a close far slower than the bound


def _end(monkeypatch, flush_s: float | None) -> tuple[float, _Workers, float]:
    clock = _Clock()
    monkeypatch.setattr(attempt, "time", clock)
    began = clock.now
    workers = _Workers(clock, flush_s)
    left = attempt.end_attempt(
        "completed",
        None,
        close_loaders=lambda: None,
        group=workers,
        flush_bound_s=BOUND_S,
        metrics=_SlowMetrics(clock),
        model=None,
        log=None,
        attempt=None,
    )
    return left, workers, began


@pytest.mark.parametrize("flush_s", [0.0, 0.5])
def test_a_slow_close_spends_none_of_the_bound_the_workers_left(monkeypatch, flush_s):
    left, workers, began = _end(monkeypatch, flush_s)
    assert workers.deadlines == [began + BOUND_S]
    assert left == BOUND_S - flush_s


def test_workers_that_used_the_whole_bound_leave_nothing(monkeypatch):
    left, _, _ = _end(monkeypatch, BOUND_S + 1.0)  # a dead collector: they gave up
    assert left == 0.0


def test_workers_that_cannot_be_asked_leave_the_whole_bound(monkeypatch):
    with pytest.warns(RuntimeWarning, match="could not export the workers' spans"):
        left, _, _ = _end(monkeypatch, None)
    assert left == BOUND_S

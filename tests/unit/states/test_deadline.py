"""A deadline save is predicted from the pace of the steps, so it ends before the deadline.

A fake clock drives the machine the way the loop does: each step takes its scripted time,
each checkpoint its save time, and the run stops when the machine says so. What is checked
is the moment the final save ends, against the deadline.
"""

from __future__ import annotations

import itertools

import pytest

from sft_runtime.events import CheckpointSaved, EventLog, LoadersReady, RunStarted
from sft_runtime.states import ControllerModel, ControllerState, StepRules
from sft_runtime.states.rules import StepPace
from tests.support.logbuild import step_event

S = ControllerState


def _run(step_times, *, deadline: float, save_s: float, save_period: int = 0):
    """Drive a machine to its end; returns (steps run, end of each save, the model)."""
    now = [0.0]
    model = ControllerModel(
        StepRules(max_steps=10_000, save_period=save_period, deadline=deadline),
        log=EventLog.in_memory(),
        clock=lambda: now[0],
    )
    model.start(event=RunStarted(placement_hash="p"))
    model.loaders_ready(event=LoadersReady(owner_ranks=[0], logical_world_size=1, restored=False))
    saves: list[float] = []
    durations = iter(step_times)
    while model.state is S.ready:
        if model.halt():
            break
        now[0] += next(durations)
        model.step_sent()
        model.commit(event=step_event(model.save_state.total_steps + 1))
        if model.state is S.saving:
            now[0] += save_s
            saves.append(now[0])
            s = model.save_state
            model.saved(
                event=CheckpointSaved(
                    step=s.total_steps,
                    path="x",
                    total_steps=s.total_steps,
                    consumed_samples=s.consumed_samples,
                    total_valid_tokens=s.total_valid_tokens,
                )
            )
    return model.save_state.total_steps, saves, model


def test_steady_steps_save_before_the_deadline_and_stop():
    steps, saves, model = _run(itertools.repeat(1.0), deadline=10.5, save_s=0.3)
    # after step 10 (t=10) another 1 s step would end at 11 > 10.5: save now, done at 10.3;
    # waiting for the deadline itself would have saved after step 11, at 11.3
    assert (steps, saves) == (10, [pytest.approx(10.3)])
    assert saves[-1] < 10.5 and model.state is S.closing and model.save_by_timeout()


def test_uneven_steps_and_periodic_saves_still_end_before_the_deadline():
    # 0.5 s and 1.5 s steps in turn, a 0.4 s save every 3 steps, deadline at 20.5 s.
    # Step 18 ends at t=20.0 (the saves after steps 3..15 included); a step of the mean
    # (20.0 / 18 = 1.11 s) would end past 20.5, so it saves now and ends at 20.4. Waiting for
    # the deadline itself would run step 19 (to 20.5) and end its save at 20.9.
    steps, saves, model = _run(
        itertools.cycle([0.5, 1.5]), deadline=20.5, save_s=0.4, save_period=3
    )
    assert steps == 18 and len(saves) == 6  # periodic at 3..15, then the deadline's at 18
    assert saves[-1] == pytest.approx(20.4) and saves[-1] < 20.5
    assert model.state is S.closing and model.pace.mean_step_s == pytest.approx(20.0 / 18)


def test_the_verdict_latches_and_a_far_deadline_never_fires():
    steps, saves, model = _run(itertools.repeat(1.0), deadline=5.0, save_s=0.0)
    assert steps == 4 and model.save_by_timeout() and model.save_by_timeout()
    model = ControllerModel(StepRules(max_steps=3, deadline=1e12), clock=lambda: 0.0)
    assert not model.save_by_timeout() and not model.deadline_within(10**6)


def test_no_step_measured_means_no_prediction():
    pace = StepPace()
    assert pace.mean_step_s == 0.0
    pace.start(100.0)
    assert pace.mean_step_s == 0.0
    pace.step_ended(103.0)
    pace.step_ended(104.0)
    assert pace.mean_step_s == 2.0
    rules = StepRules(max_steps=1, deadline=10.0)
    assert not rules.timed_out(9.9) and rules.timed_out(10.0)

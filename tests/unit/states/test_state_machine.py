"""The controller machine: the table's moves, its guards, its callbacks, and no side doors."""

from __future__ import annotations

import math

import pytest
from transitions import MachineError

from sft_runtime.events import CheckpointSaved, EventLog, LoadersReady, RunStarted
from sft_runtime.states import (
    TRANSITIONS,
    ControllerModel,
    ControllerState,
    SFTV2SaveState,
    StepRules,
    replay,
)
from sft_runtime.states.machine import mermaid
from tests.support.logbuild import step_event

S = ControllerState


def _ready(model: ControllerModel) -> None:
    model.start(event=RunStarted(placement_hash="p"))
    model.loaders_ready(event=LoadersReady(owner_ranks=[0], logical_world_size=1, restored=False))


def _checkpoint(model: ControllerModel) -> CheckpointSaved:
    s = model.save_state
    return CheckpointSaved(
        step=s.total_steps,
        path=f"checkpoints/step_{s.total_steps}",
        total_steps=s.total_steps,
        consumed_samples=s.consumed_samples,
        total_valid_tokens=s.total_valid_tokens,
    )


def drive(model: ControllerModel, *, fail_at: int | None = None) -> list[tuple[str, int]]:
    """The loop a controller runs, firing only triggers; returns (state, step) after each."""
    trail = []
    _ready(model)
    while model.state is S.loading:
        if model.halt():
            break
        model.batch_loaded()
        step = model.save_state.total_steps + 1
        if step == fail_at:
            model.fail(error=RuntimeError("boom"), phase="train")
            break
        model.commit(event=step_event(step))
        trail.append((model.state.value, step))
        if model.state is S.saving:
            model.saved(event=_checkpoint(model))
    model.finish(reason="failed" if fail_at else "completed")
    return trail


def test_a_full_run_moves_through_the_table_and_records_every_event():
    log = EventLog.in_memory()
    model = ControllerModel(StepRules(max_steps=5, save_period=2), log=log)
    trail = drive(model)
    assert trail == [
        ("loading", 1),
        ("saving", 2),
        ("loading", 3),
        ("saving", 4),
        ("saving", 5),  # the budget is reached: a final save, then closing
    ]
    assert model.state is S.closed
    types = [r.type for r in log.records(validate=True)]
    assert types.count("step_committed") == 5 and types.count("checkpoint_saved") == 3
    assert types[0] == "run_started" and types[-1] == "run_stopped"
    assert replay(log) == model.save_state
    assert model.save_state.total_steps == 5 and model.save_state.placement_hash == "p"


def test_without_checkpointing_the_budget_closes_straight_from_stepping():
    model = ControllerModel(StepRules(max_steps=2, save_period=1, checkpointing=False))
    assert drive(model) == [("loading", 1), ("closing", 2)]


def test_a_resumed_run_at_its_budget_halts_before_loading():
    from sft_runtime.states.save_state import SFTV2SaveState

    model = ControllerModel(StepRules(max_steps=3), save_state=SFTV2SaveState(total_steps=3))
    _ready(model)
    assert model.halt() is True and model.state is S.closing


def test_failure_in_stepping_records_step_aborted_with_the_error():
    log = EventLog.in_memory()
    model = ControllerModel(StepRules(max_steps=9), log=log)
    drive(model, fail_at=3)
    records = list(log.records(validate=True))
    aborted = [r for r in records if r.type == "step_aborted"]
    assert len(aborted) == 1
    assert aborted[0].data["step"] == 3 and aborted[0].data["phase"] == "train"
    assert (aborted[0].data["error_type"], aborted[0].data["error"]) == ("RuntimeError", "boom")
    assert records[-1].type == "run_stopped" and records[-1].data["reason"] == "failed"
    assert records[-1].data["last_step"] == 2 == model.save_state.total_steps


def test_deadline_forces_a_save_then_close():
    now = [0.0]
    model = ControllerModel(
        StepRules(max_steps=100, save_period=50, deadline=10.0), clock=lambda: now[0]
    )
    _ready(model)
    model.batch_loaded()
    model.commit(event=step_event(1))
    assert model.state is S.loading
    model.batch_loaded()
    now[0] = 11.0
    model.commit(event=step_event(2))
    assert model.state is S.saving
    model.saved(event=_checkpoint(model))
    assert model.state is S.closing


def test_stop_request_saves_at_the_next_boundary_and_closes():
    model = ControllerModel(StepRules(max_steps=100, save_period=0))
    _ready(model)
    model.batch_loaded()
    model.stop_requested = True
    model.commit(event=step_event(1))
    assert model.state is S.saving


def test_a_step_sent_ahead_defers_a_stop_and_the_deadline_but_not_a_periodic_save():
    """The workers already run the next step (sent whole): a stop request or the deadline at
    this commit takes effect after that step, never before; the save period still saves."""
    now = [0.0]
    model = ControllerModel(
        StepRules(max_steps=100, save_period=2, deadline=10.0), clock=lambda: now[0]
    )
    _ready(model)
    model.batch_loaded()
    model.stop_requested, model.step_ahead = True, True
    now[0] = 11.0  # past the deadline too
    assert model.stop_verdicts() == (False, False) and not model.deadline_verdict()
    model.commit(event=step_event(1))
    assert model.state is S.loading  # on to the step sent ahead
    model.batch_loaded()
    model.commit(event=step_event(2))  # the save period, with yet another step ahead
    assert model.state is S.saving
    model.saved(event=_checkpoint(model))
    assert model.state is S.loading
    assert model.last_saved_step == 2
    model.batch_loaded()
    model.step_ahead = False  # nothing more was sent: the stop and the deadline apply now
    assert model.stop_verdicts() == (True, True)
    model.commit(event=step_event(3))
    assert model.state is S.saving
    model.saved(event=_checkpoint(model))
    assert model.state is S.closing


@pytest.mark.parametrize(
    "state, trigger",
    [
        ("setup", "batch_loaded"),
        ("setup", "commit"),
        ("loading", "commit"),
        ("loading", "saved"),
        ("stepping", "batch_loaded"),
        ("stepping", "close"),
        ("saving", "commit"),
        ("closed", "fail"),
        ("closed", "finish"),
    ],
)
def test_illegal_triggers_raise(state, trigger):
    model = ControllerModel(StepRules(max_steps=5))
    model.machine.set_state(state)
    with pytest.raises(MachineError):
        getattr(model, trigger)(event=step_event(1), error=RuntimeError(), reason="failed")


def test_there_are_no_auto_transitions():
    model = ControllerModel(StepRules(max_steps=5))
    assert not hasattr(model, "to_closed") and not hasattr(model, "to_loading")


def test_a_failing_record_leaves_the_state_where_it_was():
    class FullDisk(EventLog):
        def append(self, payload, **kw):
            if payload.event_type == "step_committed":
                raise OSError(28, "No space left on device")
            return super().append(payload, **kw)

    model = ControllerModel(StepRules(max_steps=5), log=FullDisk.in_memory())
    _ready(model)
    model.batch_loaded()
    with pytest.raises(OSError):
        model.commit(event=step_event(1))
    assert model.state is S.stepping and model.save_state.total_steps == 0
    model.fail(error=OSError("disk"), phase="commit")  # the step is still abortable
    assert model.state is S.closing


def test_guards_are_pure_functions_of_state_config_and_clock():
    from sft_runtime.states.save_state import SFTV2SaveState

    rules = StepRules(max_steps=10, save_period=4, deadline=100.0)
    at = SFTV2SaveState
    assert [rules.save_due(at(total_steps=s)) for s in (0, 3, 4, 8, 10)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert rules.save_due(at(total_steps=3), timed_out=True)
    assert not rules.save_due(at(), timed_out=True)  # nothing to save before step 1
    assert rules.should_stop(at(total_steps=1), stopping=True)
    assert not StepRules(max_steps=10, checkpointing=False).save_due(at(total_steps=10))
    assert StepRules(max_steps=1).deadline == math.inf
    # the deadline fires once a step of the mean length would end past it
    assert not rules.timed_out(98.0, mean_step_s=1.5) and rules.timed_out(98.5, mean_step_s=1.5)
    assert rules.timed_out(100.0) and not rules.timed_out(99.9)


def test_mermaid_diagram_shows_every_row_of_the_table():
    text = mermaid()
    assert text.startswith("stateDiagram-v2")
    for row in TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for source in sources:
            assert f"{source} --> {row['dest'] or source}: {row['trigger']}" in text


def test_a_stop_between_steps_saves_unsaved_steps_first():
    model = ControllerModel(StepRules(max_steps=100, save_period=10), log=EventLog.in_memory())
    _ready(model)
    model.batch_loaded()
    model.commit(event=step_event(1))
    assert model.state is S.loading  # step 1 is not a save step
    model.stop_requested = True
    assert model.halt() is True and model.state is S.saving
    model.saved(event=_checkpoint(model))
    assert model.state is S.closing and model.last_saved_step == 1


def test_a_stop_right_after_a_checkpoint_closes_without_saving_again():
    model = ControllerModel(StepRules(max_steps=100, save_period=1), log=EventLog.in_memory())
    _ready(model)
    model.batch_loaded()
    model.commit(event=step_event(1))
    model.saved(event=_checkpoint(model))
    model.stop_requested = True
    assert model.halt() is True and model.state is S.closing


def test_continues_after_says_when_the_next_start_may_be_sent_ahead():
    rules = StepRules(max_steps=10, save_period=4, ft_save_period=3, deadline=1000.0)

    def follows(step: int, timed_out: bool = False, stopping: bool = False) -> bool:
        state = SFTV2SaveState(step, 0, 0, "h")
        return rules.continues_after(state, stopping=stopping, timed_out=timed_out)

    assert [s for s in range(1, 11) if follows(s)] == [1, 2, 5, 7]  # not 3,6,9 / 4,8 / 10
    assert not follows(1, timed_out=True)  # the deadline fires at the step's end
    assert not follows(1, stopping=True)
    assert StepRules(max_steps=5, checkpointing=False).continues_after(
        SFTV2SaveState(3, 0, 0, "h"), stopping=False
    )

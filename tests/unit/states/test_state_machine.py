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
from sft_runtime.states.rules import ValidationSchedule
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
    while model.state is S.ready:
        if model.halt():
            break
        model.step_sent()
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
        ("ready", 1),
        ("saving", 2),
        ("ready", 3),
        ("saving", 4),
        ("saving", 5),  # the budget is reached: a final save, then closing
    ]
    assert model.state is S.closed
    types = [r.type for r in log.records(validate=True)]
    assert types.count("step_committed") == 5 and types.count("checkpoint_saved") == 3
    assert types[0] == "run_started" and types[-1] == "run_stopped"
    assert replay(log) == model.save_state
    assert model.save_state.total_steps == 5 and model.save_state.placement_hash == "p"


def test_without_checkpointing_the_budget_closes_straight_from_training():
    model = ControllerModel(StepRules(max_steps=2, save_period=1, checkpointing=False))
    assert drive(model) == [("ready", 1), ("closing", 2)]


def test_a_resumed_run_at_its_budget_halts_before_its_first_step():
    from sft_runtime.states.save_state import SFTV2SaveState

    model = ControllerModel(StepRules(max_steps=3), save_state=SFTV2SaveState(total_steps=3))
    _ready(model)
    assert model.halt() is True and model.state is S.closing


def test_failure_in_training_records_step_aborted_with_the_error():
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
    model.step_sent()
    model.commit(event=step_event(1))
    assert model.state is S.ready
    model.step_sent()
    now[0] = 11.0
    model.commit(event=step_event(2))
    assert model.state is S.saving
    model.saved(event=_checkpoint(model))
    assert model.state is S.closing


def test_stop_request_saves_at_the_next_boundary_and_closes():
    model = ControllerModel(StepRules(max_steps=100, save_period=0))
    _ready(model)
    model.step_sent()
    model.stop_requested = True
    model.commit(event=step_event(1))
    assert model.state is S.saving


def test_a_step_sent_ahead_defers_a_stop_and_the_deadline_but_not_a_periodic_save():
    """The workers already run the next step (sent whole): a stop request or the deadline at
    this commit takes effect after that step, never before; the save period still saves."""
    now, ahead = [0.0], [False]
    model = ControllerModel(
        StepRules(max_steps=100, save_period=2, deadline=10.0),
        clock=lambda: now[0],
        step_ahead=lambda: ahead[0],
    )
    _ready(model)
    model.step_sent()
    model.stop_requested, ahead[0] = True, True
    now[0] = 11.0  # past the deadline too
    assert model.stop_verdicts() == (False, False) and not model.deadline_verdict()
    model.commit(event=step_event(1))
    assert model.state is S.ready  # on to the step sent ahead
    model.step_sent()
    model.commit(event=step_event(2))  # the save period, with yet another step ahead
    assert model.state is S.saving
    model.saved(event=_checkpoint(model))
    assert model.state is S.ready
    assert model.last_saved_step == 2
    model.step_sent()
    ahead[0] = False  # nothing more was sent: the stop and the deadline apply now
    assert model.stop_verdicts() == (True, True)
    model.commit(event=step_event(3))
    assert model.state is S.saving
    model.saved(event=_checkpoint(model))
    assert model.state is S.closing


@pytest.mark.parametrize(
    "state, trigger",
    [
        ("setup", "step_sent"),
        ("setup", "commit"),
        ("ready", "commit"),
        ("ready", "saved"),
        ("training", "step_sent"),
        ("training", "close"),
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
    assert not hasattr(model, "to_closed") and not hasattr(model, "to_ready")


def test_a_failing_record_leaves_the_state_where_it_was():
    class FullDisk(EventLog):
        def append(self, payload, **kw):
            if payload.event_type == "step_committed":
                raise OSError(28, "No space left on device")
            return super().append(payload, **kw)

    model = ControllerModel(StepRules(max_steps=5), log=FullDisk.in_memory())
    _ready(model)
    model.step_sent()
    with pytest.raises(OSError):
        model.commit(event=step_event(1))
    assert model.state is S.training and model.save_state.total_steps == 0
    model.fail(error=OSError("disk"), phase="commit")  # the step is still abortable
    assert model.state is S.closing


def test_guards_are_pure_functions_of_state_config_and_clock():
    from sft_runtime.states.save_state import SFTV2SaveState

    rules = StepRules(max_steps=10, save_period=4, deadline=100.0)
    at = SFTV2SaveState
    assert [rules.after(at(total_steps=s)).saves for s in (0, 3, 4, 8, 10)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert rules.after(at(total_steps=3), timed_out=True).saves
    assert not rules.after(at(), timed_out=True).saves  # nothing to save before step 1
    assert rules.after(at(total_steps=1), stopping=True).stop
    assert not StepRules(max_steps=10, checkpointing=False).after(at(total_steps=10)).saves
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
    model.step_sent()
    model.commit(event=step_event(1))
    assert model.state is S.ready  # step 1 is not a save step
    model.stop_requested = True
    assert model.halt() is True and model.state is S.saving
    model.saved(event=_checkpoint(model))
    assert model.state is S.closing and model.last_saved_step == 1


def test_a_stop_right_after_a_checkpoint_closes_without_saving_again():
    model = ControllerModel(StepRules(max_steps=100, save_period=1), log=EventLog.in_memory())
    _ready(model)
    model.step_sent()
    model.commit(event=step_event(1))
    model.saved(event=_checkpoint(model))
    model.stop_requested = True
    assert model.halt() is True and model.state is S.closing


def test_after_says_when_the_next_step_may_be_sent_ahead():
    rules = StepRules(max_steps=10, save_period=4, ft_save_period=3, deadline=1000.0)

    def follows(step: int, timed_out: bool = False, stopping: bool = False) -> bool:
        state = SFTV2SaveState(step, 0, 0, "h")
        return rules.after(state, stopping=stopping, timed_out=timed_out).straight_on

    assert [s for s in range(1, 11) if follows(s)] == [1, 2, 5, 7]  # not 3,6,9 / 4,8 / 10
    assert not follows(1, timed_out=True)  # the deadline fires at the step's end
    assert not follows(1, stopping=True)
    assert (
        StepRules(max_steps=5, checkpointing=False).after(SFTV2SaveState(3, 0, 0, "h")).straight_on
    )


def test_after_names_each_of_the_moves_a_step_can_be_followed_by():
    schedule = ValidationSchedule(period=3, at_start=True, at_end=True)
    rules = StepRules(max_steps=8, save_period=4, validation=schedule)
    names = {s: rules.after(SFTV2SaveState(total_steps=s)).name for s in range(9)}
    assert names == {
        0: "validate, then continue",  # val_at_start
        1: "continue",
        2: "continue",
        3: "validate, then continue",
        4: "save and continue",
        5: "continue",
        6: "validate, then continue",
        7: "continue",
        8: "validate, then save and stop",  # the budget's end: val_at_end, the final save
    }
    # a pass the log holds for the step is not run again; a stop request saves and stops
    assert rules.after(SFTV2SaveState(total_steps=3), validated=True).name == "continue"
    assert rules.after(SFTV2SaveState(total_steps=5), stopping=True).name == "save and stop"
    # without checkpointing a stop saves nothing; at step 0 there is nothing to save
    assert (
        StepRules(max_steps=2, checkpointing=False).after(SFTV2SaveState(total_steps=2)).name
        == "stop"
    )
    assert StepRules(max_steps=2).after(SFTV2SaveState(), stopping=True).name == "stop"
    # the kinds are the checkpoint's reasons, in a fixed order
    both = StepRules(max_steps=12, save_period=4, ft_save_period=6)
    assert both.after(SFTV2SaveState(total_steps=12)).save_kinds == ("periodic", "ft", "final")

"""The controller's state machine and the save state it folds events into.

Depends on `events/` only; never imports ray or torch.
"""

from sft_runtime.states.fold import apply, replay
from sft_runtime.states.machine import (
    STATES,
    TRANSITIONS,
    ControllerModel,
    ControllerState,
    StepInFlight,
    StepPhase,
    build_machine,
)
from sft_runtime.states.rules import StepRules
from sft_runtime.states.save_state import SFTV2SaveState, initial_save_state

__all__ = [
    "STATES",
    "TRANSITIONS",
    "ControllerModel",
    "ControllerState",
    "SFTV2SaveState",
    "StepInFlight",
    "StepPhase",
    "StepRules",
    "apply",
    "build_machine",
    "initial_save_state",
    "replay",
]

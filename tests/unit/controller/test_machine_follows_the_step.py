"""The machine's state says where the step's work is: ``training`` while the workers run it."""

from __future__ import annotations

from sft_runtime.states.machine import ControllerState
from tests.unit.controller.test_controller_errors import StubGroup, _controller


class WatchedGroup(StubGroup):
    """Notes the controller's state each time the controller waits for workers."""

    def __init__(self) -> None:
        super().__init__()
        self.controller = None
        self.states: list[tuple[str, ControllerState]] = []

    def _wait(self, pending, timeout_s=None):
        assert self.controller is not None
        self.states.append((pending.method, self.controller._machine.state))
        return super()._wait(pending, timeout_s)


def test_the_controller_is_training_while_the_workers_run_a_step(tmp_path):
    group = WatchedGroup()
    controller, _ = _controller(tmp_path, group)
    group.controller = controller
    controller.run()
    step_waits = [state for method, state in group.states if method == "train_sft_step"]
    assert len(step_waits) == 4  # the run's 4 steps
    assert set(step_waits) == {ControllerState.training}
    # its loader set-up and the loader states of a save are waited for outside a step
    others = {state for method, state in group.states if method != "train_sft_step"}
    assert ControllerState.training not in others
    assert controller._machine.state is ControllerState.closed

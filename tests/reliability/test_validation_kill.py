"""A SIGKILL in the middle of a validation pass, then the same command, is exact.

The run validates at the start, every 2 steps and at the end, and checkpoints at 3, 6 and 7.
The controller is killed at ``validating:after_pass@6``: every worker has validated step 6's
weights but nothing of it is recorded and step 6 is not saved. The relaunch resumes from
checkpoint 3 and must end with the log of the run that was never killed: the same training
losses, samples and final weights as a run without validation (bit for bit), the same
validation losses at the same steps as an uninterrupted run with it (bit for bit), the
validations the log kept (steps 0 and 2) not repeated, the rolled-back one (step 4) run again
and found equal by `verify`.
"""

from __future__ import annotations

from sft_runtime.events.lineage import compare_reexecutions
from sft_runtime.events.log import read_log
from sft_runtime.runtime.launch.driver import run_training
from tests.support.fixtures import val_overrides
from tests.support.reliability import STEPS, Runner, attempts_of, compare, validations
from tests.support.small_run import small_config


def test_a_kill_during_a_validation_pass_resumes_to_the_uninterrupted_log(
    ray_session, val_data, launch_env, reference, tmp_path_factory
):
    uninterrupted = tmp_path_factory.mktemp("val-reference") / "run"
    config = small_config(uninterrupted, val_data, STEPS, *val_overrides(val_data))
    assert run_training(config)["reason"] == "completed"
    ray_tmp, tag = launch_env
    runner = Runner(
        tmp_path_factory.mktemp("val-kill"),
        val_data,
        ray_tmp,
        tag,
        "val_kill",
        overrides=val_overrides(val_data),
    )
    killed = runner.launch("validating:after_pass@6")
    assert killed.rc == 1, killed.tail()
    first = attempts_of(runner.run_dir)[1]
    recorded = [r.data["step"] for r in first if r.type == "validation_completed"]
    assert recorded == [0, 2, 4]  # the pass of step 6 ran but was never recorded
    assert max(r.data["step"] for r in first if r.type == "step_committed") == 6
    runner.finish()
    attempts = attempts_of(runner.run_dir)
    second = attempts[max(attempts)]
    assert second[0].data["resumed_from_step"] == 3
    again = [r.data["step"] for r in second if r.type == "validation_completed"]
    assert again == [4, 6, 7]  # neither 0 nor 2 repeated, none skipped

    assert validations(runner.run_dir) == validations(uninterrupted)
    cmp = compare(runner.run_dir, reference)  # training as with validation off
    assert cmp.mismatches == [] and cmp.steps_compared == STEPS
    compared, diverged = compare_reexecutions(read_log(runner.run_dir))
    assert compared == 4 and diverged == []  # steps 4, 5, 6 and the validation of step 4

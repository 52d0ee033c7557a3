"""A diverged step never bricks a run, through the real `sft-runtime` command.

- By default a step whose loss or gradient norm is not finite is not applied: the run stops
  with one line naming the step and the value (exit 1), records the aborted step and
  ``run_stopped`` (``diverged``), and every tool still reads the log. The same command with
  a sane learning rate then resumes from the last checkpoint and ends on exactly the losses
  and samples of a run that never diverged.
- With ``sft.skip_nonfinite_steps: true`` such steps are committed without their update and
  counted; the log, with NaN losses in it, is read by every tool.
"""

from __future__ import annotations

import math
import subprocess

import yaml

from sft_runtime.events import read_log
from sft_runtime.events.schemas import as_float
from tests.support.reliability import (
    STEPS,
    Runner,
    committed,
    compare,
)

HUGE_LR = "1.0e+30"  # the first update leaves weights so large that the next loss is NaN


def _set(runner: Runner, **changes: object) -> None:
    """Edit the run's config file as a user would between two launches."""
    raw = yaml.safe_load(runner.config.read_text())
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    runner.config.write_text(yaml.safe_dump(raw))


def _train(runner: Runner, *extra: str) -> subprocess.CompletedProcess:
    return runner.cli("train", str(runner.config), "--run-dir", str(runner.run_dir), *extra)


def _tools_read(runner: Runner) -> None:
    """Every command that reads a log takes this one (exit 0, no traceback)."""
    run = str(runner.run_dir)
    for args in (
        ("events", run),
        ("events", run, "--timeline"),
        ("events", run, "--plot", str(runner.root / "plot.png")),
        ("replay", run),
        ("verify", run),
        ("diff", run, run),
    ):
        done = runner.cli(*args)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
        assert "Traceback" not in done.stdout + done.stderr, args


def test_a_diverged_step_stops_the_run_and_a_smaller_lr_resumes_it_exactly(make_runner, reference):
    runner = make_runner("diverge")
    _set(runner, **{"sft.max_num_steps": 3})  # a good checkpoint at step 3 (save_period 3)
    first = _train(runner)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    _set(runner, **{"sft.max_num_steps": STEPS, "policy.optimizer.kwargs.lr": float(HUGE_LR)})
    diverged = _train(runner, "--allow-config-change")
    assert diverged.returncode == 1, diverged.stdout[-3000:] + diverged.stderr[-3000:]
    assert "Traceback" not in diverged.stdout + diverged.stderr
    # one line says why it stopped (the resume's note of the changed lr is on its own line)
    lines = [line for line in diverged.stderr.splitlines() if line.startswith("sft-runtime")]
    assert len(lines) == 1, diverged.stderr
    assert "step 5 diverged (loss nan" in lines[0] and "step_3" in lines[0], lines[0]

    records = list(read_log(runner.run_dir))
    aborted = [r for r in records if r.type == "step_aborted"]
    assert [(r.attempt, r.data["step"], r.data["error_type"]) for r in aborted] == [
        (2, 5, "DivergedError")
    ]
    assert records[-1].type == "run_stopped" and records[-1].data["reason"] == "diverged"
    steps = [r for r in records if r.type == "step_committed"]
    assert all(math.isfinite(as_float(r.data["loss"])) for r in steps)
    assert max(r.data["step"] for r in steps) == 4  # step 5 never counted
    _tools_read(runner)

    _set(runner, **{"policy.optimizer.kwargs.lr": 3e-3})  # the config's own rate again
    resumed = _train(runner)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from step 3" in resumed.stdout, resumed.stdout[-2000:]
    # the steps in effect, their samples and losses, the final weights, against a clean run;
    # verify passes (attempt 2's step 4 ran under another lr, a change the log records)
    cmp = compare(runner.run_dir, reference)
    assert not cmp.mismatches, cmp.mismatches
    assert sorted(committed(runner.run_dir)) == list(range(1, STEPS + 1))


def test_skipped_non_finite_steps_are_committed_counted_and_readable(make_runner):
    runner = make_runner("skip", overrides=(f"policy.optimizer.kwargs.lr={HUGE_LR}",))
    _set(runner, **{"sft.skip_nonfinite_steps": True})
    done = _train(runner)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = {step: loss for step, (loss, _) in committed(runner.run_dir).items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert math.isfinite(losses[1])
    skipped = [s for s, loss in losses.items() if not math.isfinite(as_float(loss))]
    assert skipped, losses  # lr 1e30 makes every step after the first diverge
    assert f"{len(skipped)} step(s) with a non-finite loss" in done.stdout, done.stdout[-2000:]
    _tools_read(runner)

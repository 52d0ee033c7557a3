"""`sft-runtime trace RUN_DIR [--step N]` on a run written by three processes."""

from __future__ import annotations

import argparse
import shutil

import orjson
import pytest

from sft_runtime.runtime.cli import trace as trace_cli
from sft_runtime.runtime.errors import UserInputError


def _trace(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    trace_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["trace", *map(str, argv)])
    return args.func(args)


def test_prints_the_last_step_by_default(traced_run, capsys):
    assert _trace(traced_run["run_dir"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    step_trace = traced_run["steps"]["2"][0]
    assert lines[0].startswith(f"trace {step_trace}")
    assert lines[1].startswith("rl.sft_v2.step  ") and "step=2" in lines[1]
    assert "[controller]" in lines[1] and " ms  " in lines[1]
    assert sum("rl.sft_v2.worker.train_step" in line for line in lines) == 2
    assert any("[worker[0]]" in line for line in lines)
    assert any("[worker[1]]" in line for line in lines)
    assert sum("ERROR" in line for line in lines) == 2  # each worker's failed optimizer span
    # the worker spans nest under policy_training, under the step
    policy = next(i for i, line in enumerate(lines) if "policy_training" in line)
    assert lines[policy].startswith("`- ")
    assert lines[policy + 1].lstrip(" |`-").startswith("rl.sft_v2.worker.train_step")


def test_step_option_and_out_file(traced_run, capsys, tmp_path):
    out_file = tmp_path / "step1.json"
    assert _trace(traced_run["run_dir"], "--step", "1", "--out", out_file) == 0
    out = capsys.readouterr().out
    assert "step=1" in out.splitlines()[1]
    [trace] = orjson.loads(out_file.read_bytes())["data"]
    assert trace["traceID"] == traced_run["steps"]["1"][0]


def test_reads_merged_files_when_parts_are_gone(traced_run, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    shutil.copy(traced_run["merged"][0], run / "traces")
    assert _trace(run, "--step", "2") == 0
    assert "rl.sft_v2.worker.train_step" in capsys.readouterr().out
    (run / "traces" / "run-attempt1.json").write_bytes(b'{"data": [')
    with pytest.raises(UserInputError, match="run-attempt1.json"):
        _trace(run)


@pytest.mark.parametrize("case", ["missing", "no_traces", "no_such_step"])
def test_bad_input_is_a_user_error(case, traced_run, tmp_path):
    if case == "missing":
        with pytest.raises(UserInputError, match="no such run directory"):
            _trace(tmp_path / "nope")
    elif case == "no_traces":
        with pytest.raises(UserInputError, match="no trace files"):
            _trace(tmp_path)
    else:
        with pytest.raises(UserInputError, match=r"no trace for step 99 \(steps traced: 1..2\)"):
            _trace(traced_run["run_dir"], "--step", "99")

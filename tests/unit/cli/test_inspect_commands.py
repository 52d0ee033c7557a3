"""`sft-runtime events | replay | verify`: output, exit codes, and no ray or torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sft_runtime.runtime.cli.main import main
from tests.support.logbuild import Attempt, totals_at, write_checkpoint, write_run

BIN = Path(sys.executable).parent / "sft-runtime"


@pytest.fixture
def run_dir(tmp_path):
    write_run(
        tmp_path,
        [Attempt(until=6, save_every=3, stop=None, abort_at=5), Attempt(until=8, resume=3)],
    )
    write_checkpoint(tmp_path, 3)  # the one the log counts (its step 6 was rolled back)
    return tmp_path


def test_events_shows_attempts_aborts_and_endings(run_dir, capsys):
    assert main(["events", str(run_dir), "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "1-6 (6)" in out and "4-8 (5)" in out  # steps of each attempt
    assert "crashed" in out and "completed" in out
    assert "aborted step 5 in train: RuntimeError" in out
    assert "step_committed" in out and "trace=" in out


def test_replay_prints_the_save_state_at_a_step(run_dir, capsys):
    assert main(["replay", str(run_dir), "--step", "4", "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert [state["total_steps"], state["consumed_samples"], state["total_valid_tokens"]] == (
        totals_at(4)
    )
    assert main(["replay", str(run_dir)]) == 0
    assert "total_steps          8" in capsys.readouterr().out


def test_replay_past_the_end_is_bad_input(run_dir, capsys):
    assert main(["replay", str(run_dir), "--step", "50"]) == 2
    assert "ends at step 8" in capsys.readouterr().err


def test_verify_passes_an_exact_resume(run_dir, capsys):
    assert main(["verify", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "chain intact" in out and "re-executed steps compared: 3, divergent: 0" in out


def test_verify_reports_the_first_divergent_step(tmp_path, capsys):
    write_run(
        tmp_path, [Attempt(until=6, save_every=3, stop=None), Attempt(until=6, resume=3, salt="x")]
    )
    assert main(["verify", str(tmp_path)]) == 1
    assert "first divergence: step 4: sample_digests differ" in capsys.readouterr().err


def test_damaged_log_exits_2_with_file_and_line(run_dir, capsys):
    path = run_dir / "events.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4].replace(b'"loss":', b'"loss":1')
    path.write_bytes(b"".join(lines))
    for command in ("events", "replay", "verify"):
        assert main([command, str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert f"{path} line 5: digest mismatch" in err and "Traceback" not in err


def test_missing_run_dir_exits_2(tmp_path, capsys):
    assert main(["events", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main(["verify", str(tmp_path)]) == 2
    assert "no event log" in capsys.readouterr().err


def test_console_script_inspects_without_importing_torch_or_ray(run_dir):
    code = (
        "import sys; from runtime.cli import main; rc = main(sys.argv[1:]); "
        "heavy = [m for m in ('torch', 'ray', 'megatron') if m in sys.modules]; "
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    for command in ("events", "replay", "verify"):
        out = subprocess.run(
            [sys.executable, "-c", code, command, str(run_dir)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "HEAVY []" in out
    proc = subprocess.run(
        [str(BIN), "verify", str(run_dir)], capture_output=True, text=True, env=dict(os.environ)
    )
    assert proc.returncode == 0 and "chain intact" in proc.stdout


def test_bad_arguments_exit_2():
    proc = subprocess.run([str(BIN), "replay"], capture_output=True, text=True)
    assert proc.returncode == 2 and "run_dir" in proc.stderr

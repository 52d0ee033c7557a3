"""`sft-runtime demo --toy` end to end: data, training, checkpoints, traces; a re-run resumes.

(The real-model demo, the default, is proven by tests/integration/real_model.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sft_runtime.events import history, read_log

BIN = Path(sys.executable).parent / "sft-runtime"


def test_demo_trains_and_a_second_run_resumes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_AUTH_MODE"] = "disabled"
    run_dir = tmp_path / "demo"
    command = [str(BIN), "demo", "--toy", "--run-dir", str(run_dir)]
    first = subprocess.run(
        [*command, "--steps", "3"], capture_output=True, text=True, env=env, timeout=300
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "completed: 3 steps, loss" in first.stdout
    assert "sample completions (before -> after)" in first.stdout
    assert (run_dir / "traces" / "run-attempt1.json").is_file()
    assert (run_dir / "checkpoints" / "step_3").is_dir()

    second = subprocess.run(
        [*command, "--steps", "2"], capture_output=True, text=True, env=env, timeout=300
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from step 3" in second.stdout and "5/5 steps done" in second.stdout
    attempts = history(read_log(run_dir)).attempts
    assert [(a.first_step, a.last_step, a.outcome) for a in attempts] == [
        (1, 3, "completed"),
        (4, 5, "completed"),
    ]

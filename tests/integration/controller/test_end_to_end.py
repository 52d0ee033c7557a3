"""End to end with real Ray, energon and torch: train, interrupt with SIGTERM, resume exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from sft_runtime.events import read_log, records_in_effect
from sft_runtime.runtime.checkpoint.store import CheckpointDir
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.data.tokenizer import ByteTokenizer
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.metrics.metrics_log import read_metrics
from sft_runtime.states import replay
from tests.support.small_run import small_config, small_raw

BIN = Path(sys.executable).parent / "sft-runtime"


def _committed(run_dir: Path) -> dict[int, tuple[float, list[str]]]:
    """step -> (loss, per-rank sample digests) over the records in effect."""
    return {
        r.data["step"]: (r.data["loss"], r.data["sample_digests"])
        for r in records_in_effect(read_log(run_dir))
        if r.type == "step_committed"
    }


def test_train_events_metrics_and_checkpoints_agree(ray_session, demo_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    summary = run_training(small_config(run_dir, demo_data, 6))
    assert summary["reason"] == "completed" and summary["total_steps"] == 6
    # no telemetry section: the driver still gets a flush budget (its handle may be on,
    # from an earlier run in the same program)
    assert summary["telemetry_flush_s"] > 0
    committed = _committed(run_dir)
    assert sorted(committed) == [1, 2, 3, 4, 5, 6]
    assert all(len(digests) == 2 and digests[0] != digests[1] for _, digests in committed.values())
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["train"]["loss"] for r in rows] == [committed[s][0] for s in range(1, 7)]
    assert rows[-1]["train"]["loss"] < rows[0]["train"]["loss"]
    for key in ("loader_latency_max", "policy_time", "total_step_time", "valid_tokens_per_second"):
        assert rows[0]["train"][key] > 0
    ckpt = CheckpointDir(run_dir / "checkpoints")
    assert ckpt.steps() == [3, 6]
    for step in (3, 6):
        info = ckpt.info(step)
        assert info["save_state"] == replay(run_dir, until_step=step).to_dict()
        policy = ckpt.path(step) / "policy"
        assert (policy / "weights" / "model.safetensors").is_file()
        assert (ckpt.path(step) / "sft_v2_loaders.pt").is_file()
        tokenizer = json.loads((policy / "tokenizer" / "tokenizer_config.json").read_text())
        assert tokenizer == {"identity": ByteTokenizer().identity(), "name": "byte"}
    state = replay(run_dir)
    assert (state.total_steps, state.consumed_samples) == (6, summary["consumed_samples"])
    assert cli_main(["verify", str(run_dir)]) == 0
    assert "checkpoints agree: [3, 6]" in capsys.readouterr().out


def _hold_file(path: Path, proc: subprocess.Popen, lines: list[str]) -> None:
    """Until the run holds at its fault point (a run that ends first fails the test)."""
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"exit {proc.returncode} before the hold:\n" + "".join(lines))
        time.sleep(0.01)


def _read_lines(proc: subprocess.Popen, lines: list[str], seen: threading.Event, text: str):
    """Collect the launch's output in a thread; ``seen`` is set once a line holds ``text``."""

    def read():
        for line in proc.stdout:
            lines.append(line)
            if text in line:
                seen.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_sigterm_then_the_same_command_resumes_exactly(ray_session, demo_data, tmp_path):
    """The run holds right after step 2 is durable; SIGTERM arrives there, and once the
    command says the stop was taken the run is released: it must stop after step 3 (sent to
    the workers with step 2, before the signal: a step sent ahead is never taken back), save,
    and the same command must resume to the uninterrupted run's losses bit for bit."""
    steps, stop_at = 8, 2
    reference = tmp_path / "reference"
    run_training(small_config(reference, demo_data, steps))

    run_dir = tmp_path / "interrupted"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(small_raw(run_dir, demo_data, steps)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "SFT_RUNTIME"))}
    env["RAY_AUTH_MODE"] = "disabled"
    hold = tmp_path / "held"
    held_env = dict(
        env, SFT_RUNTIME_FAULT=f"stepping:after_record@{stop_at}", SFT_RUNTIME_FAULT_HOLD=str(hold)
    )
    command = [str(BIN), "train", str(config), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        command, env=held_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    taken = threading.Event()
    reader = _read_lines(proc, lines, taken, "stop requested")
    _hold_file(hold, proc, lines)
    proc.send_signal(signal.SIGTERM)
    while not taken.wait(0.1):  # the driver prints it once the controller took the request
        assert proc.poll() is None, "".join(lines)
    hold.unlink()
    proc.wait(timeout=240)
    reader.join(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 130, out
    stopped = [r for r in read_log(run_dir) if r.type == "run_stopped"]
    assert [r.data["reason"] for r in stopped] == ["interrupted"]
    stop_step = stopped[0].data["last_step"]
    assert stop_step == stop_at + 1
    assert stop_step in CheckpointDir(run_dir / "checkpoints").steps()  # saved on the way out

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from step {stop_step}" in again.stdout
    assert _committed(run_dir) == _committed(reference)  # losses and sample ids, bit for bit
    attempts = sorted({r.attempt for r in read_log(run_dir)})
    assert attempts == [1, 2]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "already reached" in done.stdout
    verify = subprocess.run([str(BIN), "verify", str(run_dir)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    info = json.loads(
        (run_dir / "checkpoints" / f"step_{steps}" / "training_info.json").read_text()
    )
    assert info["save_state"]["total_steps"] == steps

"""A model folder with bad weight files is refused before Ray starts: exit code 2 and one line
naming the file, where the workers used to fail with pages of tracebacks (exit 1).

The real console script runs as a subprocess with a Ray root of its own, so "Ray never
started" is checked on disk: that root stays empty and the run directory holds no event log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.config_files.overrides import apply_override
from tests.support.fixtures import hf_overrides
from tests.support.reliability import BIN
from tests.support.small_run import small_raw


def _train(model: Path, data: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    raw = small_raw(run_dir, data, 3)
    for item in hf_overrides(model):
        apply_override(raw, item)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    ray_root = Path(tempfile.mkdtemp(prefix="sftbadhf-"))  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(ray_root), COLUMNS="200")
    try:
        done = subprocess.run(
            [str(BIN), "train", str(config), "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert not any(ray_root.iterdir()), f"Ray started: {sorted(ray_root.iterdir())}"
    finally:
        shutil.rmtree(ray_root, ignore_errors=True)
    return done, run_dir


def _assert_refused(done: subprocess.CompletedProcess, run_dir: Path, named: Path) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("sft-runtime train: error: policy.model_name: ")
    assert str(named) in lines[0] and "Traceback" not in done.stderr + done.stdout
    assert not (run_dir / "events.jsonl").exists()
    return lines[0]


@pytest.fixture
def model(tiny_llama, tmp_path) -> Path:
    """A copy of the session's tiny Llama (tokenizer and all) to damage."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


def test_a_folder_without_its_weights_file_exits_2_naming_it(model, demo_data, tmp_path):
    (model / "model.safetensors").unlink()
    done, run_dir = _train(model, demo_data, tmp_path)
    line = _assert_refused(done, run_dir, model / "model.safetensors")
    assert "no such file" in line


def test_a_truncated_weights_file_exits_2_naming_it(model, demo_data, tmp_path):
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 2 // 3])
    done, run_dir = _train(model, demo_data, tmp_path)
    line = _assert_refused(done, run_dir, weights)
    assert "truncated" in line

"""No file in a run directory or a model folder runs code when a command reads it.

A received run directory is input like any other. A ``.metadata`` pickle dropped into a
checkpoint's ``policy/weights/`` (or put in place of a sharded checkpoint's real one) is
refused by every command that reads the checkpoint, with one line and exit 2, and its payload
never runs; a tokenizer file that is a link is refused by ``export`` and a sub-folder is
copied; ``reproduce`` runs where the user says, never where the checkpoint's config points;
and a ``reproduce`` ended by SIGTERM leaves no copy of the checkpoint in its TMPDIR.

Two small LoRA runs of the tiny Llama (LoRA, so that ``export --merge`` applies) are made
once for the module, one unsharded on one worker and one sharded (FSDP2) on two; every check
works on a copy.
"""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.launch.driver import run_training
from tests.support.fixtures import hf_overrides
from tests.support.reliability import BIN, TAG_VAR, reap
from tests.support.small_run import small_config

STEPS = 3  # checkpoints at 2 (hf_overrides' save_period) and 3 (the end)
CHECKPOINTS = (2, 3)
LORA = (
    "policy.dtensor_cfg.lora_cfg.enabled=true",
    "policy.dtensor_cfg.lora_cfg.dim=4",
    "policy.dtensor_cfg.lora_cfg.alpha=8",
)
ONE_WORKER = ("cluster.workers_per_node=1",)
SHARDED = ("policy.dtensor_cfg.enabled=true",)
SUBPROCESS_TIMEOUT_S = 300.0


def _make_run(root: Path, demo_data: Path, model: Path, *extra: str) -> Path:
    run_dir = root / "run"
    config = small_config(run_dir, demo_data, STEPS, *hf_overrides(model), *LORA, *extra)
    summary = run_training(config)
    assert summary["reason"] == "completed" and summary["total_steps"] == STEPS
    return run_dir


@pytest.fixture(scope="module")
def lora_run(ray_session, demo_data, tiny_llama, tmp_path_factory) -> Path:
    return _make_run(tmp_path_factory.mktemp("crafted-lora"), demo_data, tiny_llama, *ONE_WORKER)


@pytest.fixture(scope="module")
def lora_fsdp_run(ray_session, demo_data, tiny_llama, tmp_path_factory) -> Path:
    return _make_run(tmp_path_factory.mktemp("crafted-fsdp"), demo_data, tiny_llama, *SHARDED)


class _Payload:
    """Unpickled, it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}"


def _copy(run_dir: Path, dest: Path) -> tuple[Path, Path]:
    """A copy of the run and the config its user trains it with (a file of their own)."""
    shutil.copytree(run_dir, dest)
    config = dest.parent / f"{dest.name}.yaml"
    shutil.copyfile(_checkpoint(dest, STEPS) / "config.yaml", config)
    return dest, config


def _set_in_config(checkpoint: Path, section: str, key: str, value) -> None:
    path = checkpoint / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    node = raw
    for part in section.split("."):
        node = node[part]
    node[key] = value
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def _refused(argv: list[str], capsys) -> str:
    """The command exits 2 with one line on stderr, which is returned."""
    capsys.readouterr()
    rc = cli_main(argv)
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert rc == 2, f"exit {rc}:\n{out.out}\n{out.err}"
    assert len(lines) == 1, out.err
    assert lines[0].startswith(f"sft-runtime {argv[0]}: error: "), out.err
    return lines[0]


COMMANDS = ("export", "export --merge", "samples", "reproduce", "resume")


def _argv(command: str, run_dir: Path, config: Path, tmp_path: Path) -> list[str]:
    out = tmp_path / "out"
    return {
        "export": ["export", str(run_dir), str(out)],
        "export --merge": ["export", str(run_dir), str(out), "--merge"],
        "samples": ["samples", str(run_dir), "--step", str(STEPS)],
        "reproduce": [
            "reproduce",
            str(run_dir),
            "--step",
            str(STEPS),
            "--scratch",
            str(tmp_path / "s"),
        ],
        "resume": ["train", str(config), "--run-dir", str(run_dir)],
    }[command]


def _crafted(run_dir: Path, tmp_path: Path, how: str) -> tuple[Path, Path, Path]:
    """A copy of ``run_dir`` whose checkpoints hold a crafted ``.metadata`` (``how``:
    dropped beside unsharded weights, the same with config.yaml claiming FSDP, or in place
    of a sharded checkpoint's real weights or optimizer metadata); returns the copy, the
    user's config and the marker file the payload would create."""
    run, config = _copy(run_dir, tmp_path / "run")
    marker = tmp_path / "payload-ran"
    for step in CHECKPOINTS:
        policy = _checkpoint(run, step) / "policy"
        folder = policy / ("optimizer" if how == "optimizer" else "weights")
        if how in ("replaced", "optimizer"):
            assert (folder / ".metadata").is_file()  # a sharded checkpoint's real one
        (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
        if how == "claimed":
            _set_in_config(_checkpoint(run, step), "policy.dtensor_cfg", "enabled", True)
    return run, config, marker


@pytest.mark.parametrize("command", COMMANDS)
def test_a_metadata_pickle_beside_unsharded_weights_is_refused(lora_run, tmp_path, capsys, command):
    run, config, marker = _crafted(lora_run, tmp_path, "dropped")
    line = _refused(_argv(command, run, config, tmp_path), capsys)
    assert "policy/weights" in line and "sharded" in line, line
    assert "policy.dtensor_cfg.enabled=false" in line, line
    assert not marker.exists(), "the crafted pickle ran"


@pytest.mark.parametrize("command", COMMANDS)
def test_a_metadata_pickle_with_a_config_claiming_fsdp_runs_nothing(
    lora_run, tmp_path, capsys, command
):
    run, config, marker = _crafted(lora_run, tmp_path, "claimed")
    line = _refused(_argv(command, run, config, tmp_path), capsys)
    assert "refusing to unpickle global posix.system" in line, line
    assert "policy/weights/.metadata" in line, line
    assert not marker.exists(), "the crafted pickle ran"


@pytest.mark.parametrize("command", COMMANDS)
def test_a_sharded_checkpoints_metadata_replaced_by_a_payload_runs_nothing(
    lora_fsdp_run, tmp_path, capsys, command
):
    run, config, marker = _crafted(lora_fsdp_run, tmp_path, "replaced")
    line = _refused(_argv(command, run, config, tmp_path), capsys)
    assert "refusing to unpickle global posix.system" in line, line
    assert "policy/weights/.metadata" in line, line
    assert not marker.exists(), "the crafted pickle ran"


@pytest.mark.parametrize("command", ("samples", "reproduce", "resume"))
def test_a_sharded_optimizers_metadata_replaced_by_a_payload_runs_nothing(
    lora_fsdp_run, tmp_path, capsys, command
):
    run, config, marker = _crafted(lora_fsdp_run, tmp_path, "optimizer")
    line = _refused(_argv(command, run, config, tmp_path), capsys)
    assert "refusing to unpickle global posix.system" in line, line
    assert "policy/optimizer/.metadata" in line, line
    assert not marker.exists(), "the crafted pickle ran"


def test_the_real_sharded_checkpoint_still_exports_and_resumes_through_the_allow_list(
    lora_fsdp_run, tmp_path, capsys
):
    """The allow-list admits everything a real sharded checkpoint holds (weights, optimizer
    with its non-tensor entries): export and reproduce of the untouched run succeed."""
    run, _ = _copy(lora_fsdp_run, tmp_path / "run")
    assert cli_main(["export", str(run), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    scratch = tmp_path / "scratch"
    argv = ["reproduce", str(run), "--step", str(STEPS), "--scratch", str(scratch)]
    assert cli_main(argv) == 0, capsys.readouterr()
    assert "identical" in capsys.readouterr().out


# ----------------------------------------------------------------------------- tokenizer
def test_export_refuses_a_tokenizer_link_and_copies_a_sub_folder(lora_run, tmp_path, capsys):
    run, _ = _copy(lora_run, tmp_path / "run")
    tokenizer = _checkpoint(run, STEPS) / "policy" / "tokenizer"
    secret = tmp_path / "outside.txt"
    secret.write_text("a file outside the run")
    (tokenizer / "notes.txt").symlink_to(secret)
    line = _refused(["export", str(run), str(tmp_path / "a")], capsys)
    assert str(tokenizer / "notes.txt") in line and "link" in line, line
    assert not (tmp_path / "a").exists()
    (tokenizer / "notes.txt").unlink()
    (tokenizer / "extra").symlink_to(tmp_path, target_is_directory=True)  # a linked folder
    line = _refused(["export", str(run), str(tmp_path / "b")], capsys)
    assert str(tokenizer / "extra") in line and "link" in line, line
    (tokenizer / "extra").unlink()
    (tokenizer / "extra" / "deeper").mkdir(parents=True)
    (tokenizer / "extra" / "deeper" / "vocab.txt").write_text("words\n")
    (tokenizer / "extra" / "link.txt").symlink_to(secret)  # a link inside a sub-folder
    line = _refused(["export", str(run), str(tmp_path / "c")], capsys)
    assert str(tokenizer / "extra" / "link.txt") in line, line
    (tokenizer / "extra" / "link.txt").unlink()
    assert cli_main(["export", str(run), str(tmp_path / "d")]) == 0, capsys.readouterr().err
    assert (tmp_path / "d" / "extra" / "deeper" / "vocab.txt").read_text() == "words\n"
    assert (tmp_path / "d" / "tokenizer.json").is_file()
    assert not any(p.is_symlink() for p in (tmp_path / "d").rglob("*"))


# ----------------------------------------------------------------------------- reproduce
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(launch_env, tmpdir: Path | None = None) -> tuple[dict[str, str], str]:
    ray_tmp, session_tag = launch_env
    tag = f"{session_tag}:crafted:{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(ray_tmp), COLUMNS="200")
    env[TAG_VAR] = tag
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return env, tag


def test_reproduce_never_connects_where_the_checkpoints_config_points(
    lora_run, tmp_path, launch_env
):
    run, _ = _copy(lora_run, tmp_path / "run")
    address = f"127.0.0.1:{_closed_port()}"
    for step in CHECKPOINTS:
        _set_in_config(_checkpoint(run, step), "cluster", "address", address)
    env, tag = _env(launch_env)
    argv = [str(BIN), "reproduce", str(run), "--step", str(STEPS), "--scratch", str(tmp_path / "s")]
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
        )
    finally:
        reap(tag, grace_s=10)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "identical" in done.stdout and address not in out, out


def test_reproduce_takes_placement_from_the_user_and_the_computation_from_the_checkpoint(
    lora_run, tmp_path
):
    from sft_runtime.runtime.debug.reproduce import reproduce_config
    from sft_runtime.runtime.debug.start import find_start

    run, _ = _copy(lora_run, tmp_path / "run")
    for step in CHECKPOINTS:
        checkpoint = _checkpoint(run, step)
        _set_in_config(checkpoint, "cluster", "address", "10.9.8.7:6379")
        _set_in_config(checkpoint, "cluster", "placement_strategy", "SPREAD")
        _set_in_config(checkpoint, "cluster", "worker_niceness", -20)
    start = find_start(run, STEPS)
    config = reproduce_config(start, tmp_path / "s")
    assert config.cluster.address is None
    assert config.cluster.placement_strategy == "PACK"
    assert config.cluster.worker_niceness == 0
    assert config.cluster.world_size == 1  # the run's data-parallel size decides the numbers
    mine = reproduce_config(start, tmp_path / "s", ["cluster.address=127.0.0.1:6380"])
    assert mine.cluster.address == "127.0.0.1:6380"


def test_a_reproduce_ended_by_sigterm_leaves_no_copy_in_its_tmpdir(lora_run, tmp_path, launch_env):
    run, _ = _copy(lora_run, tmp_path / "run")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env, tag = _env(launch_env, tmpdir)
    argv = [str(BIN), "reproduce", str(run), "--step", str(STEPS)]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        t0 = time.monotonic()
        # the moment: the checkpoint's copy is complete (the log follows it into the scratch)
        while not list(tmpdir.glob("*/run/events.jsonl")):
            if proc.poll() is not None or time.monotonic() - t0 > SUBPROCESS_TIMEOUT_S:
                raise AssertionError(f"no copy appeared in {tmpdir}:\n{proc.communicate()[0]}")
            time.sleep(0.01)
        assert list(tmpdir.glob(f"*/run/checkpoints/step_{CHECKPOINTS[0]}/policy"))
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        reap(tag, grace_s=10)
    assert proc.returncode == 130, out
    assert "sft-runtime reproduce: interrupted" in out, out
    assert sorted(p.name for p in tmpdir.iterdir()) == [], out

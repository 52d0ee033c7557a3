"""A full disk ends a run with one line and exit 1; nothing saved is lost; the same command
resumes once there is room again.

The run directory lies on a small ext4 filesystem mounted from a loop device (root only),
so the write that fails is a real one: the operating system says ENOSPC, no test double
does. How full the disk is comes from what the run writes (one checkpoint of the small
config fits beside the logs, a second does not), never from timing.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from sft_runtime.events import read_log
from tests.support.reliability import BIN, LAUNCH_TIMEOUT_S, STEPS, TAG_VAR, reap, verify
from tests.support.small_run import small_raw

FS_SIZE = "40M"
# A checkpoint of the small config is about 470 KB on disk, the logs of a whole run under
# 20 KB: with this much room the first checkpoint (step 3) fits, the second (step 6) not.
ROOM_FOR_ONE_CHECKPOINT = 720 * 1024
ERROR_PREFIX = "sft-runtime train: error: "


# ----------------------------------------------------------------------------- the disk
def _why_no_loop_mount() -> str | None:
    if os.geteuid() != 0:
        return "mounting a loop filesystem needs root"
    if not shutil.which("mkfs.ext4") or not shutil.which("mount"):
        return "mkfs.ext4 or mount is not installed"
    if not Path("/dev/loop-control").exists() and not list(Path("/dev").glob("loop[0-9]*")):
        return "no loop devices (/dev/loop*)"
    return None


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A mounted 40 MB ext4 (no blocks reserved for root), unmounted at the end."""
    why = _why_no_loop_mount()
    if why is not None:
        pytest.skip(why)
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", FS_SIZE, str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mounted = subprocess.run(
        ["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop filesystem here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int) -> None:
    """Take all but ``leave`` bytes of the filesystem with the file ``path``."""
    take = free_bytes(path.parent) - leave
    assert take > 0, f"only {free_bytes(path.parent)} bytes free"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, take)
        os.fsync(fd)
    finally:
        os.close(fd)


def fill_up(path: Path) -> None:
    """Write ``path`` until the filesystem refuses another byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 16, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- launches
@dataclass
class Done:
    rc: int
    stdout: str
    stderr: str

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith(ERROR_PREFIX)]


def launch(config: Path, run_dir: Path, ray_tmp: Path, tag: str) -> Done:
    """`sft-runtime train CONFIG --run-dir RUN` as a user types it; every process it left is
    ended (by pid) before this returns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(ray_tmp), COLUMNS="200")
    env[TAG_VAR] = tag
    try:
        proc = subprocess.run(
            [str(BIN), "train", str(config), "--run-dir", str(run_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT_S,
            start_new_session=True,
        )
    finally:
        reap(tag)
    return Done(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line_disk_full(done: Done) -> str:
    output = done.stdout + done.stderr
    assert done.rc == 1, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    lines = done.error_lines()
    assert len(lines) == 1, done.stderr[-6000:]
    assert "no space left on device" in lines[0], lines[0]
    return lines[0]


def assert_checkpoints_complete(run_dir: Path) -> list[str]:
    ckpt = run_dir / "checkpoints"
    names = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []
    assert not [n for n in names if n.startswith("tmp_step_")], names
    for name in names:
        for part in ("training_info.json", "config.yaml", "sft_v2_loaders.pt", "policy/weights"):
            assert (ckpt / name / part).exists(), f"{name} lacks {part}"
    return names


# ----------------------------------------------------------------------------- the test
def test_a_full_disk_is_one_line_and_the_same_command_resumes(
    small_disk, demo_data, launch_env, tmp_path
):
    ray_tmp, session_tag = launch_env
    run_dir = small_disk / "run"
    config = tmp_path / "run.yaml"  # off the small disk
    config.write_text(yaml.safe_dump(small_raw(run_dir, demo_data, STEPS)))

    # 1. room for the logs and one checkpoint: the save at step 6 runs out of space
    fill(small_disk / "filler", ROOM_FOR_ONE_CHECKPOINT)
    first = launch(config, run_dir, ray_tmp, f"{session_tag}:full:1")
    line = assert_one_line_disk_full(first)
    assert "resume from step 3" in line, line
    assert assert_checkpoints_complete(run_dir) == ["step_3"]
    records = list(read_log(run_dir, validate=True))
    assert records[-1].type == "run_stopped", records[-1]
    assert records[-1].data["reason"] == "failed"
    assert "No space left on device" in records[-1].data["error"]
    assert verify(run_dir)[0] == 0

    # 2. a resume started with not one byte free
    fill_up(small_disk / "filler-2")
    assert free_bytes(small_disk) == 0
    second = launch(config, run_dir, ray_tmp, f"{session_tag}:full:2")
    assert "resume from step 3" in assert_one_line_disk_full(second)
    assert assert_checkpoints_complete(run_dir) == ["step_3"]
    assert verify(run_dir)[0] == 0  # a refused append left no partial line

    # 3. room again: the same command resumes from step 3 and finishes
    (small_disk / "filler").unlink()
    (small_disk / "filler-2").unlink()
    third = launch(config, run_dir, ray_tmp, f"{session_tag}:full:3")
    assert third.rc == 0, (third.stdout + third.stderr)[-6000:]
    assert "resumed from step 3" in third.stdout, third.stdout[-3000:]
    assert assert_checkpoints_complete(run_dir) == ["step_3", "step_6", "step_7"]
    rc, out = verify(run_dir)
    assert rc == 0, out

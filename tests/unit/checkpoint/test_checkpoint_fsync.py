"""Each checkpoint file is fsynced exactly where its durability is decided.

A file written on its own (`save_checkpoint`, an export) is fsynced with its directory by
the writer. A worker's files written beside the next steps are not: the controller's commit
fsyncs the whole ``tmp_step_N`` folder (`fsync_tree`) before the rename that makes it a
checkpoint, and that must reach every one of them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.checkpoint import policy_files as ckpt
from sft_runtime.runtime.checkpoint.store import fsync_tree


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths os.fsync is called on, in order."""
    paths: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return paths


def _write_share(root: Path, *, fsync: bool) -> list[str]:
    """What a rank writes into a checkpoint: weights, optimizer state, an RNG file."""
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    files = ckpt.save_weights(str(root / "weights"), tensors, fsync=fsync)
    files.append(
        ckpt.save_torch(str(root / "optimizer" / "optimizer.pt"), {"step": 3}, fsync=fsync)
    )
    files.append(ckpt.save_torch(str(root / "rng" / "rank_0.pt"), {"seed": 1}, fsync=fsync))
    return files


def test_a_file_on_its_own_is_fsynced_with_its_directory(tmp_path: Path, fsynced: list[str]):
    files = _write_share(tmp_path, fsync=True)
    for path in files:
        assert f"{path}.tmp.{os.getpid()}" in fsynced  # the file, before its rename
        assert os.path.dirname(path) in fsynced  # and the directory holding the rename


def test_files_left_to_the_commit_are_complete_and_the_commit_fsyncs_them(
    tmp_path: Path, fsynced: list[str]
):
    tmp = tmp_path / "tmp_step_3"
    files = _write_share(tmp / "policy", fsync=False)
    assert fsynced == []  # nothing synced while the next step trains
    assert sorted(str(p) for p in tmp.rglob("*") if p.is_file()) == sorted(files)  # no .tmp left
    assert torch.equal(
        ckpt.load_weights(str(tmp / "policy" / "weights"))["w"], torch.arange(6.0).reshape(2, 3)
    )
    assert torch.load(files[-1], weights_only=True) == {"seed": 1}

    fsync_tree(tmp)  # what `CheckpointDir.commit` does before its rename
    for path in files:
        assert path in fsynced
        assert os.path.dirname(path) in fsynced
    assert str(tmp) in fsynced

"""`safe_dcp`: torch.distributed.checkpoint folders read without running code from them.

A real folder (tensors and the plain non-tensor entries an optimizer state holds) loads as
torch loads it; a crafted ``.metadata`` (or a rank's ``__0.metadata``), metadata naming a
file outside its folder, and a non-tensor entry whose pickle calls a function are refused
with one line naming the file, and nothing they name is run.
"""

from __future__ import annotations

import os
import pickle
import shlex
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sft_runtime.runtime.checkpoint import safe_dcp
from sft_runtime.runtime.errors import UserInputError


class _Payload:
    """Unpickled, it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _save(folder: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def _state() -> dict:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)},
        "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]},
    }


def test_a_real_folder_loads_as_torch_loads_it(tmp_path):
    _save(tmp_path / "ckpt", _state())
    empty = {
        "model": {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optimizer": {"param_groups": [{"lr": None, "betas": None, "params": None}]},
    }
    safe_dcp.load(empty, tmp_path / "ckpt", no_dist=True)
    want = _state()
    assert torch.equal(empty["model"]["w"], want["model"]["w"])
    assert torch.equal(empty["model"]["b"], want["model"]["b"])
    assert empty["optimizer"] == want["optimizer"]


def test_a_crafted_metadata_is_refused_naming_the_file_and_the_global(tmp_path):
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    _save(folder, _state())
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (folder / "__0.metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UserInputError) as exc:
        safe_dcp.read_metadata(folder)
    assert str(exc.value).startswith(f"{folder / '.metadata'}: refusing to unpickle global ")
    assert "posix.system" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(UserInputError, match=r"__0\.metadata: refusing to unpickle global"):
        safe_dcp.SafeFileSystemReader(folder).read_metadata(rank=0)
    with pytest.raises(UserInputError, match="posix.system"):
        safe_dcp.load({"model": {"w": torch.zeros(2, 3)}}, folder, no_dist=True)
    assert not marker.exists()


def test_metadata_naming_a_file_outside_its_folder_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    _save(folder, _state())
    metadata = safe_dcp.read_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserInputError, match="'../elsewhere.distcp', which is not a file"):
        safe_dcp.read_metadata(folder)


def test_a_non_tensor_entry_that_calls_a_function_is_refused(tmp_path):
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    _save(folder, {"w": torch.ones(2), "extra": _Payload(marker)})
    with pytest.raises(UserInputError) as exc:
        safe_dcp.load({"w": torch.zeros(2), "extra": None}, folder, no_dist=True)
    message = str(exc.value)
    assert message.startswith(f"{folder}: refusing the entry 'extra'") and "\n" not in message
    assert not marker.exists()
    # the file is what it claims: torch's own reader runs it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"w": torch.zeros(2), "extra": None}, storage_reader=dcp.FileSystemReader(folder))
    assert marker.exists()


def test_a_damaged_metadata_file_is_one_line(tmp_path):
    folder = tmp_path / "ckpt"
    _save(folder, _state())
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserInputError, match="unreadable checkpoint metadata") as exc:
        safe_dcp.read_metadata(folder)
    assert "\n" not in str(exc.value)

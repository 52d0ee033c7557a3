"""`DirectFile` and `write_safetensors`: the bytes a checkpoint file gets, direct or not.

Real files on the test's disk; where that filesystem refuses O_DIRECT, or a write does,
the refusal is made by patching `os.open` / `os.write` (an error path), and the same bytes
must land either way.
"""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from sft_runtime.runtime.checkpoint import direct_io
from sft_runtime.runtime.checkpoint.direct_io import CHUNK, DirectFile, write_safetensors


def _payload(size: int) -> bytes:
    return random.Random(size).randbytes(size)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, CHUNK, 2 * CHUNK + 123])
def test_the_file_holds_exactly_the_bytes_written_in_uneven_pieces(tmp_path, size):
    data = _payload(size)
    path = tmp_path / "f.bin"
    with DirectFile(str(path)) as fh:
        at = 0
        for piece in (1, 4095, 70_000, CHUNK - 3, size):  # across block and chunk edges
            fh.write(data[at : at + piece])
            at += piece
        assert fh.size == size
    assert path.read_bytes() == data


def test_torch_save_through_it_loads_back(tmp_path):
    state = {
        "state": {0: {"exp_avg": torch.randn(300, 500), "step": torch.tensor(3.0)}},
        "half": torch.randn(7).bfloat16(),
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    path = tmp_path / "optimizer.pt"
    with DirectFile(str(path)) as fh:
        torch.save(state, fh)
    back = torch.load(path, weights_only=True)
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert torch.equal(back["half"], state["half"]) and back["param_groups"] == [
        {"lr": 0.1, "params": [0]}
    ]


def test_safetensors_written_here_read_by_safetensors(tmp_path):
    tensors = {
        "w": torch.randn(300, 7),
        "transposed": torch.randn(4, 5).t(),  # not contiguous
        "half": torch.randn(9).bfloat16(),
        "fp16": torch.randn(2, 2).half(),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }
    path = tmp_path / "model.safetensors"
    with DirectFile(str(path)) as fh:
        write_safetensors(fh, tensors, {"format": "pt"})
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_a_dtype_safetensors_lacks_is_refused_by_name(tmp_path):
    with DirectFile(str(tmp_path / "x")) as fh, pytest.raises(ValueError, match="odd"):
        write_safetensors(fh, {"odd": torch.zeros(2, dtype=torch.complex64)})


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_filesystem_that_refuses_direct_opens_gets_a_plain_file(tmp_path, monkeypatch, refusal):
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & direct_io._DIRECT:
            raise OSError(refusal, os.strerror(refusal))
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io, "_DIRECT", getattr(os, "O_DIRECT", 0o40000))
    monkeypatch.setattr(os, "open", refuse_direct)
    data = _payload(CHUNK + 5000)
    with DirectFile(str(tmp_path / "f")) as fh:
        assert not fh.direct
        fh.write(data)
    assert (tmp_path / "f").read_bytes() == data


def test_a_direct_write_refused_midway_goes_on_buffered(tmp_path, monkeypatch):
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    probe = DirectFile(str(tmp_path / "probe"))
    probe.close()
    if not probe.direct:
        pytest.skip("this filesystem refuses O_DIRECT at open")
    real_write, refused = os.write, []

    def refuse_once(fd, data):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refuse_once)
    data = _payload(2 * CHUNK + 77)
    with DirectFile(str(tmp_path / "f")) as fh:
        fh.write(data)
        assert not fh.direct
    assert refused and (tmp_path / "f").read_bytes() == data


def test_two_files_open_at_once_in_one_thread_do_not_share_a_buffer(tmp_path):
    a, b = _payload(CHUNK + 10), _payload(CHUNK + 20)[::-1]
    with DirectFile(str(tmp_path / "a")) as fa, DirectFile(str(tmp_path / "b")) as fb:
        for i in range(0, len(b), 1 << 16):
            fa.write(a[i : i + (1 << 16)])
            fb.write(b[i : i + (1 << 16)])
    assert (tmp_path / "a").read_bytes() == a and (tmp_path / "b").read_bytes() == b


def test_another_open_error_is_not_taken_for_a_refusal(tmp_path):
    with pytest.raises(FileNotFoundError):
        DirectFile(str(tmp_path / "no" / "such" / "folder" / "f"))

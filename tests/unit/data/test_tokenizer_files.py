"""The tokenizer goes into every checkpoint, so the checkpoint alone says how its ids were made."""

from __future__ import annotations

import json

import pytest

from sft_runtime.runtime.data.tokenizer import ByteTokenizer, TokenizerSpec, save_tokenizer
from sft_runtime.runtime.errors import UserInputError


def test_the_byte_tokenizer_is_described_by_name_and_identity(tmp_path):
    for spec in (None, {"name": "byte"}, TokenizerSpec()):  # how workers may hold the spec
        out = tmp_path / str(id(spec))
        written = save_tokenizer(spec, out)
        assert written == [str(out / "tokenizer_config.json")]
        info = json.loads((out / "tokenizer_config.json").read_text())
        assert info == {"name": "byte", "identity": ByteTokenizer().identity()}


def test_a_hugging_face_tokenizers_files_are_copied_and_weights_are_not(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    files = {
        "tokenizer.json": '{"model": {"type": "BPE"}}',
        "tokenizer_config.json": '{"chat_template": "{{ messages }}"}',
        "special_tokens_map.json": '{"eos_token": "</s>"}',
    }
    for name, text in files.items():
        (source / name).write_text(text)
    (source / "model.safetensors").write_bytes(b"\0" * 64)
    (source / "config.json").write_text("{}")
    out = tmp_path / "ckpt" / "policy" / "tokenizer"
    spec = TokenizerSpec(name=str(source))
    written = save_tokenizer(spec, out)
    assert sorted(p.rsplit("/", 1)[1] for p in written) == sorted(files)
    assert {p.name: p.read_text() for p in out.iterdir()} == files


def test_a_folder_without_tokenizer_files_is_named(tmp_path):
    spec = TokenizerSpec(name=str(tmp_path))
    with pytest.raises(UserInputError, match=str(tmp_path)):
        save_tokenizer(spec, tmp_path / "out")

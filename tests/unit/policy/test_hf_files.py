"""A local model folder's weight files are checked from their headers: each refusal is one
line naming the file (and the tensor), on real folders written by ``save_pretrained``."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy.hf_files import check_hf_weights
from sft_runtime.runtime.policy.model_path import hf_config
from tests.support.hf_models import build_model, tiny_model

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One tiny Llama saved twice: as one file, and as shards of 20 KB plus their index."""
    root = tmp_path_factory.mktemp("hf-files")
    model = build_model(root / "single", family="llama", vocab_size=97, max_positions=64)
    model.save_pretrained(str(root / "sharded"), max_shard_size="20KB")
    return {"single": root / "single", "sharded": root / "sharded"}


@pytest.fixture
def single(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved["single"], tmp_path / "single"))


@pytest.fixture
def sharded(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved["sharded"], tmp_path / "sharded"))


def _check(folder: Path) -> None:
    check_hf_weights(str(folder), hf_config(str(folder)))


def _refused(folder: Path) -> str:
    with pytest.raises(UserInputError) as info:
        _check(folder)
    message = str(info.value)
    assert "\n" not in message and message.startswith("policy.model_name: ")
    return message


def _header_length(file: Path) -> int:
    return struct.unpack("<Q", file.read_bytes()[:8])[0]


def _weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX).read_text())["weight_map"]


def _edit_config(folder: Path, **values) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def _rewrite(file: Path, edit) -> None:
    """Load a safetensors file, let `edit` change the dict of tensors, save it back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- good folders
def test_a_good_single_file_passes(single):
    _check(single)


def test_a_good_sharded_folder_passes(sharded):
    assert not (sharded / WEIGHTS).exists()
    assert len(set(_weight_map(sharded).values())) >= 3
    _check(sharded)


def test_tied_weights_the_file_omits_and_extra_tensors_pass(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model(LlamaConfig, LlamaForCausalLM, vocab_size=97, tie_word_embeddings=True)
    model.save_pretrained(str(tmp_path))
    from safetensors import safe_open

    with safe_open(str(tmp_path / WEIGHTS), "pt") as fh:
        assert "lm_head.weight" not in fh.keys()  # tied: saved once, as the embedding
    _check(tmp_path)
    _rewrite(tmp_path / WEIGHTS, lambda t: t.update({"model.rotary_emb.inv_freq": torch.ones(8)}))
    _check(tmp_path)  # an extra tensor transformers drops on load is no reason to refuse


def test_a_folder_of_pytorch_model_bin_passes_on_its_existence(single):
    (single / WEIGHTS).unlink()
    (single / "pytorch_model.bin").write_bytes(b"not read")
    _check(single)


def test_only_the_headers_are_read(single):
    """A file with a 64 MB tensor is checked by reading a few KB of it (/proc/self/io)."""
    _rewrite(single / WEIGHTS, lambda t: t.update({"extra.big": torch.zeros(16 * 2**20)}))
    config = hf_config(str(single))
    check_hf_weights(str(single), config)  # imports done

    def read_bytes() -> int:
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(io["rchar"])

    before = read_bytes()
    check_hf_weights(str(single), config)
    read = read_bytes() - before
    assert (single / WEIGHTS).stat().st_size > 64 * 2**20
    assert read < 256 * 1024, read


# ----------------------------------------------------------------------------- missing files
def test_a_missing_weights_file_is_named_with_the_names_looked_for(single):
    (single / WEIGHTS).unlink()
    message = _refused(single)
    assert f"{single / WEIGHTS}: no such file" in message
    assert INDEX in message and "pytorch_model.bin" in message


def test_a_missing_shard_is_named(sharded):
    shard = sorted(set(_weight_map(sharded).values()))[1]
    (sharded / shard).unlink()
    message = _refused(sharded)
    assert f"{sharded / INDEX}: 1 of its" in message and str(sharded / shard) in message


def test_a_tensor_the_index_puts_in_the_wrong_shard_is_named(sharded):
    weight_map = _weight_map(sharded)
    name, shard = next(iter(weight_map.items()))
    other = next(s for s in sorted(set(weight_map.values())) if s != shard)
    weight_map[name] = other
    index = json.loads((sharded / INDEX).read_text())
    (sharded / INDEX).write_text(json.dumps({**index, "weight_map": weight_map}))
    message = _refused(sharded)
    assert str(sharded / INDEX) in message and f"{name} (in {other})" in message


# ----------------------------------------------------------------------------- damaged files
@pytest.mark.parametrize("keep", ["half", "all but one byte", "header only"])
def test_a_file_truncated_in_its_data_is_named(single, keep):
    file = single / WEIGHTS
    data = file.read_bytes()
    cut = {"half": len(data) // 2, "all but one byte": len(data) - 1}
    file.write_bytes(data[: cut.get(keep, 8 + _header_length(file))])
    message = _refused(single)
    assert (
        f"{file}: truncated: its header needs" in message and "tensors lie past the end" in message
    )


@pytest.mark.parametrize("keep", [0, 5, "half the header", "all but one header byte"])
def test_a_file_truncated_inside_its_header_is_named(single, keep):
    file = single / WEIGHTS
    n = _header_length(file)
    cut = {"half the header": 8 + n // 2, "all but one header byte": 8 + n - 1}.get(keep, keep)
    file.write_bytes(file.read_bytes()[:cut])
    message = _refused(single)
    assert f"{file}: truncated" in message


def test_a_sharded_file_truncated_is_named(sharded):
    shard = sharded / sorted(set(_weight_map(sharded).values()))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert f"{shard}: truncated" in _refused(sharded)


def test_a_garbage_length_field_is_named(single):
    file = single / WEIGHTS
    file.write_bytes(b"\xff\x13garbage" + file.read_bytes()[9:])
    assert f"{file}: not a safetensors file" in _refused(single)


def test_a_header_that_is_not_json_is_named(single):
    file = single / WEIGHTS
    data = bytearray(file.read_bytes())
    data[8:16] = b"#garbage"  # the length stays, the JSON does not
    file.write_bytes(bytes(data))
    assert f"{file}: unreadable header" in _refused(single)


def test_header_offsets_that_do_not_tile_the_data_are_named(single):
    """A header whose tensors overlap (the file's length unchanged) is caught by name."""
    file = single / WEIGHTS
    data = file.read_bytes()
    n = _header_length(file)
    header = json.loads(data[8 : 8 + n])
    name = "model.norm.weight"
    begin, end = header[name]["data_offsets"]
    shift = 4 if begin >= 4 else -4
    header[name]["data_offsets"] = [begin - shift, end - shift]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    file.write_bytes(data[:8] + raw + data[8 + n :])
    message = _refused(single)
    assert f"{file}: damaged header: tensor" in message


def test_bytes_past_the_last_tensor_are_named(single):
    file = single / WEIGHTS
    file.write_bytes(file.read_bytes() + b"\0" * 16)
    assert f"{file}: 16 bytes past the last tensor" in _refused(single)


# ----------------------------------------------------------------------------- against config
@pytest.mark.parametrize("key", ["vocab_size", "hidden_size"])
def test_a_config_of_another_shape_names_file_tensor_and_both_shapes(single, key):
    _edit_config(single, **{key: 101 if key == "vocab_size" else 96})
    message = _refused(single)
    assert f"{single / WEIGHTS}: " in message and "of another shape than" in message
    if key == "vocab_size":
        assert "model.embed_tokens.weight [97, 64] (expected [101, 64])" in message
        assert "lm_head.weight [97, 64] (expected [101, 64])" in message
    else:
        assert "(and " in message and "more)" in message  # every layer: three shown, a count


def test_a_sharded_config_of_another_shape_names_the_shard(sharded):
    _edit_config(sharded, vocab_size=101)
    shard = _weight_map(sharded)["model.embed_tokens.weight"]
    message = _refused(sharded)
    assert "model.embed_tokens.weight [97, 64] (expected [101, 64])" in message
    assert shard in message


def test_a_tensor_missing_from_the_file_is_named(single):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(single / WEIGHTS, lambda t: t.pop(name))
    message = _refused(single)
    assert f"{single / WEIGHTS}: 1 tensors" in message and message.endswith(name)


def test_a_layer_more_in_config_names_what_is_missing_and_counts_it(single):
    _edit_config(single, num_hidden_layers=3)
    message = _refused(single)
    assert "9 tensors that the model of" in message and "model.layers.2." in message
    assert "(and 6 more)" in message

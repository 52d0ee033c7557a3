"""A Hugging Face model's config is checked before Ray starts, each error naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.config import validate_config
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.launch.setup import check_model_covers
from tests.support.hf_models import build_model
from tests.support.small_run import small_raw

BIN = Path(sys.executable).parent / "sft-runtime"


def _raw(folder: Path, **policy) -> dict:
    raw = small_raw(Path("/tmp/run"), Path("/tmp/data"))
    raw["policy"]["model"] = {}  # the built-in transformer's sizes mean nothing here
    raw["policy"]["model_name"] = str(folder)
    raw["policy"].update(policy)
    return raw


@pytest.fixture(scope="module")
def model_only(tmp_path_factory) -> Path:
    """A model folder with a 97-token vocabulary and 64 positions (no tokenizer needed)."""
    out = tmp_path_factory.mktemp("llama")
    build_model(out, family="llama", vocab_size=97, max_positions=64)
    return out


def test_the_tokenizer_defaults_to_the_models_own(model_only):
    config = validate_config(_raw(model_only))
    assert config.policy.tokenizer.name == str(model_only)
    assert config.policy.tokenizer.path == str(model_only)


def test_a_byte_tokenizer_with_an_hf_model_is_refused(model_only):
    with pytest.raises(UserInputError, match="policy.tokenizer.name is 'byte'"):
        validate_config(_raw(model_only, tokenizer={"name": "byte"}))


def test_the_attention_implementation_is_a_checked_key(model_only):
    raw = _raw(model_only)
    raw["policy"]["model"]["attn_implementation"] = "eager"
    assert validate_config(raw).policy.model.attn_implementation == "eager"
    raw["policy"]["model"]["attn_implementation"] = "flash_attention_9"
    with pytest.raises(UserInputError, match="policy.model.attn_implementation"):
        validate_config(raw)


def test_eager_attention_with_packing_is_refused_naming_both_keys(model_only):
    raw = _raw(model_only, sequence_packing={"enabled": True})
    assert validate_config(raw).policy.model.attn_implementation == "sdpa"  # the default packs
    raw["policy"]["model"]["attn_implementation"] = "eager"
    with pytest.raises(UserInputError, match=r"attn_implementation 'eager'.*sequence_packing"):
        validate_config(raw)


def test_vocabulary_and_positions_must_cover_tokenizer_and_rows(model_only):
    config = validate_config(_raw(model_only))  # max_input_seq_length 64 = the positions
    check_model_covers(config, 97)
    with pytest.raises(UserInputError, match=r"config.json vocab_size \(97\) is smaller"):
        check_model_covers(config, 98)
    raw = _raw(model_only)
    raw["data"]["max_input_seq_length"] = 128
    with pytest.raises(UserInputError, match=r"128\) exceeds .*max_position_embeddings \(64\)"):
        check_model_covers(validate_config(raw), 97)


@pytest.mark.parametrize("what", ["no such model folder", "no config.json"])
def test_a_missing_model_folder_or_config_exits_2_before_ray(what, demo_data, tmp_path):
    folder = tmp_path / "model"
    if what == "no config.json":
        folder.mkdir()
    raw = small_raw(tmp_path / "run", demo_data)
    raw["policy"].pop("model", None)
    raw["policy"]["model_name"] = str(folder)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    done = subprocess.run(
        [str(BIN), "train", str(config), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "policy.model_name" in done.stderr
    assert what in done.stderr


def test_the_hf_example_config_validates(model_only):
    from sft_runtime.runtime.config import load_config

    root = Path(__file__).resolve().parents[3]
    config = load_config(root / "examples" / "hf.yaml", [f"policy.model_name={model_only}"])
    assert config.policy.is_hf and config.policy.tokenizer.path == str(model_only)
    assert config.policy.sequence_packing.algorithm == "modified_first_fit_decreasing"

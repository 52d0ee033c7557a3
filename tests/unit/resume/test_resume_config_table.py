"""The table of keys that decide a step, and the comparison a resume runs before Ray.

The table must classify every leaf of `MasterConfig` (walked from the pydantic models, so a
key added later fails here until someone decides what it is); the comparison refuses shape
changes always, computation changes unless allowed, lets optimizer keys change after a
divergence, and judges paths by content.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from sft_runtime.events.schemas import parse_payload
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.resume.config_change import (
    IDENTITIES_INFO_KEY,
    check_resume_config,
    config_record,
    resume_notes,
)
from sft_runtime.runtime.resume.config_keys import (
    COMPUTE,
    FREE,
    IDENTITY_KEYS,
    KEY_KINDS,
    OPTIMIZER,
    PLACEMENT,
    SHAPE,
    config_leaves,
)
from sft_runtime.runtime.resume.input_identity import (
    data_set_identity,
    model_config_identity,
    tokenizer_identity,
)
from tests.support.small_run import small_config


def test_every_key_of_the_config_is_classified_once():
    leaves = config_leaves()
    assert len(leaves) == len(set(leaves))
    unclassified = sorted(set(leaves) - set(KEY_KINDS))
    assert unclassified == [], "classify these in runtime/resume/config_keys.py"
    stale = sorted(set(KEY_KINDS) - set(leaves))
    assert stale == [], "the table names keys the config no longer has"
    assert set(IDENTITY_KEYS) <= set(KEY_KINDS)
    assert set(KEY_KINDS.values()) == {SHAPE, COMPUTE, OPTIMIZER, PLACEMENT, FREE}


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("policy.model.d_model", SHAPE),
        ("policy.model_name", SHAPE),
        ("policy.train_micro_batch_size", COMPUTE),
        ("policy.train_global_batch_size", COMPUTE),
        ("policy.precision", COMPUTE),
        ("data.max_input_seq_length", COMPUTE),
        ("data.energon.shuffle_buffer_size", COMPUTE),
        ("sft.seed", COMPUTE),
        ("cluster.num_threads_per_worker", COMPUTE),
        ("policy.optimizer.name", OPTIMIZER),
        ("policy.optimizer.kwargs", OPTIMIZER),
        ("policy.scheduler", OPTIMIZER),
        ("policy.max_grad_norm", OPTIMIZER),
        ("sft.max_num_steps", FREE),
        ("checkpointing.save_period", FREE),
        ("checkpointing.keep_top_k", FREE),
        ("cluster.address", FREE),
        ("cluster.call_timeout_s", FREE),
        ("logger.log_dir", FREE),
        ("telemetry.enabled", FREE),
        ("data_plane.max_partitions", FREE),
    ],
)
def test_what_decides_a_step(key, kind):
    assert KEY_KINDS[key] == kind


def _data_set(folder: Path, samples: int = 16) -> Path:
    meta = folder / ".nv-meta"
    meta.mkdir(parents=True)
    (meta / ".info.json").write_text(json.dumps({"shard_counts": {"train-0.tar": samples}}))
    (meta / "split.yaml").write_text("split_parts:\n  train:\n  - train-0.tar\n")
    (meta / "index.uuid").write_text("0f0f")
    (folder / "train-0.tar").write_bytes(b"x" * 1024)
    return folder


def test_a_data_set_is_identified_by_content_not_path(tmp_path):
    first = _data_set(tmp_path / "a")
    copy = tmp_path / "b"
    shutil.copytree(first, copy)
    assert data_set_identity(first) == data_set_identity(copy)
    (copy / "train-0.tar").write_bytes(b"x" * 2048)  # another shard
    assert data_set_identity(first) != data_set_identity(copy)
    assert data_set_identity(tmp_path / "none") is None


def test_a_model_folder_is_identified_by_its_architecture_and_tokenizer(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "hidden_size": 64, "_name_or_path": "/old/place"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text('{"vocab": 1}')
    (folder / "model.safetensors").write_bytes(b"w" * 64)
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    (moved / "config.json").write_text(json.dumps({**config, "_name_or_path": "/new"}))
    (moved / "model.safetensors").write_bytes(b"v" * 64)  # weights come from the checkpoint
    assert model_config_identity(str(folder)) == model_config_identity(str(moved))
    assert tokenizer_identity(str(folder)) == tokenizer_identity(str(moved))
    (moved / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    assert model_config_identity(str(folder)) != model_config_identity(str(moved))
    (moved / "tokenizer.json").write_text('{"vocab": 2}')
    assert tokenizer_identity(str(folder)) != tokenizer_identity(str(moved))
    assert model_config_identity("org/name") == "hub:org/name"


def _checkpoint(tmp_path: Path, config, *, attempt: int = 1) -> Path:
    """A step_3 folder holding what a save writes for the comparison."""
    ckpt = tmp_path / "checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    info = {"attempt": attempt, IDENTITIES_INFO_KEY: config_record(config).identities}
    (ckpt / "training_info.json").write_text(json.dumps(info))
    return ckpt


def test_computation_changes_need_the_flag_and_are_recorded(tmp_path):
    data = _data_set(tmp_path / "data")
    ckpt = _checkpoint(tmp_path, small_config(tmp_path / "run", data))
    changed = small_config(tmp_path / "run", data, 6, "policy.train_micro_batch_size=4")
    with pytest.raises(UserInputError) as info:
        check_resume_config(changed, ckpt)
    message = str(info.value)
    assert "\n" not in message
    assert "policy.train_micro_batch_size: 2 -> 4" in message
    assert "--allow-config-change" in message and str(ckpt) in message
    allowed = small_config(
        tmp_path / "run",
        data,
        6,
        "policy.train_micro_batch_size=4",
        "checkpointing.allow_config_change=true",
    )
    record = check_resume_config(allowed, ckpt)
    assert record.changes == {"policy.train_micro_batch_size": [2, 4]}
    assert record.digest != config_record(small_config(tmp_path / "run", data)).digest
    assert "policy.train_micro_batch_size: 2 -> 4" in resume_notes(record, 3)[0]


def test_free_keys_and_a_moved_data_set_are_no_change(tmp_path):
    data = _data_set(tmp_path / "data")
    ckpt = _checkpoint(tmp_path, small_config(tmp_path / "run", data))
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    shutil.rmtree(data)  # the old path is gone: the recorded identity decides
    later = small_config(
        tmp_path / "elsewhere",
        moved,
        20,
        "checkpointing.save_period=5",
        "cluster.call_timeout_s=30",
        "data_plane.max_partitions=2",
    )
    record = check_resume_config(later, ckpt)
    assert record.changes == {}
    assert record.digest == config_record(small_config(tmp_path / "run", moved)).digest
    assert resume_notes(record, 3) == []


def test_a_data_set_with_other_content_is_a_change(tmp_path):
    data = _data_set(tmp_path / "data")
    ckpt = _checkpoint(tmp_path, small_config(tmp_path / "run", data))
    other = _data_set(tmp_path / "other", samples=17)
    with pytest.raises(UserInputError, match="data.train.path: .*other"):
        check_resume_config(small_config(tmp_path / "run", other), ckpt)


@pytest.mark.parametrize("override", ["policy.model.d_model=64", "policy.model.n_layers=2"])
def test_a_shape_change_is_refused_even_when_allowed(tmp_path, override):
    data = _data_set(tmp_path / "data")
    ckpt = _checkpoint(tmp_path, small_config(tmp_path / "run", data))
    allowed = small_config(
        tmp_path / "run", data, 6, override, "checkpointing.allow_config_change=true"
    )
    with pytest.raises(UserInputError, match="cannot be loaded into another model"):
        check_resume_config(allowed, ckpt)


def test_after_a_divergence_optimizer_keys_change_without_the_flag(tmp_path):
    data = _data_set(tmp_path / "data")
    ckpt = _checkpoint(tmp_path, small_config(tmp_path / "run", data))
    smaller = small_config(tmp_path / "run", data, 6, "policy.optimizer.kwargs.lr=0.001")
    with pytest.raises(UserInputError, match="policy.optimizer.kwargs.lr: 0.003 -> 0.001"):
        check_resume_config(smaller, ckpt)
    record = check_resume_config(smaller, ckpt, diverged=True)
    assert record.changes == {"policy.optimizer.kwargs.lr": [0.003, 0.001]}
    both = small_config(tmp_path / "run", data, 6, "policy.optimizer.kwargs.lr=0.001", "sft.seed=1")
    with pytest.raises(UserInputError, match="sft.seed: 7 -> 1") as info:
        check_resume_config(both, ckpt, diverged=True)
    assert "policy.optimizer.kwargs.lr" not in str(info.value)


def test_a_fresh_optimizer_is_said(tmp_path):
    data = _data_set(tmp_path / "data")
    ckpt = _checkpoint(tmp_path, small_config(tmp_path / "run", data))
    record = check_resume_config(
        small_config(tmp_path / "run", data), ckpt, optimizer_restored=False
    )
    assert record.optimizer_restored is False
    (note,) = resume_notes(record, 3)
    assert "AdamW starts fresh" in note


def test_a_checkpoint_without_its_config_needs_the_flag(tmp_path):
    data = _data_set(tmp_path / "data")
    ckpt = _checkpoint(tmp_path, small_config(tmp_path / "run", data))
    (ckpt / "config.yaml").unlink()
    with pytest.raises(UserInputError, match="config.yaml: missing"):
        check_resume_config(small_config(tmp_path / "run", data), ckpt)


def test_a_version_1_run_started_reads_as_not_compared():
    payload = parse_payload("run_started", {"placement_hash": "p", "config_digest": None})
    assert payload.schema_version == 2
    assert payload.config_changes is None and payload.optimizer_restored is None

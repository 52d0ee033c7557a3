"""NeMo RL's data keys: a local JSONL file (`openai_format` or `ResponseDataset`) that the
run prepares itself, once, into a cached energon data set; its held-out split as validation;
one epoch one pass. A real two-worker run on such a config trains, validates and resumes
exactly, and bad files or names are one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from sft_runtime.events import read_log
from sft_runtime.events.run_diff import step_facts
from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.config import validate_config
from sft_runtime.runtime.data.bring import bring_data, prepared_data_set
from sft_runtime.runtime.data.demo import demo_conversation
from sft_runtime.runtime.data.record_shapes import RecordShape
from sft_runtime.runtime.errors import UserInputError
from tests.support.fixtures import data_set_messages
from tests.support.small_run import small_raw

CHATS = 60


def _openai_lines(path: Path, count: int = CHATS, seed: int = 0) -> list[list[dict]]:
    """NeMo RL's openai_format under its own keys: `conversation` holds the chat, `sys` a
    system message, and keys the shape does not read are there too (ignored, as NeMo RL
    ignores them)."""
    rng, chats = random.Random(seed), []
    with path.open("w") as f:
        for i in range(count):
            chat = [m for m in demo_conversation(rng) if m["role"] != "system"]
            chats.append(chat)
            row = {"conversation": chat, "id": i, "source": "test"}
            if i % 2:
                row["sys"] = f"system {i}"
            f.write(json.dumps(row) + "\n")
    return chats


def _nemo_rl_raw(tmp_path: Path, data_file: Path, steps: int, **train) -> dict:
    raw = small_raw(tmp_path / "run", tmp_path / "unused", steps)
    raw["data"]["train"] = {
        "dataset_name": "openai_format",
        "data_path": str(data_file),
        "chat_key": "conversation",
        "system_key": "sys",
        "system_prompt": "You are terse.",
        "split_validation_size": 0.2,
        **train,
    }
    raw["sft"].update(val_period=2, val_batches=1, val_global_batch_size=4)
    # room for the system message and the reply (at 64 bytes some replies are cut away)
    raw["policy"]["model"]["max_seq_len"] = raw["data"]["max_input_seq_length"] = 256
    return raw


def test_a_file_is_prepared_once_in_its_shape_and_found_again(tmp_path, capfd):
    source = tmp_path / "chats.jsonl"
    chats = _openai_lines(source)
    shape = RecordShape(chat_key="conversation", system_key="sys", system_prompt="Be terse.")
    cache = tmp_path / "cache"
    first = prepared_data_set(source, shape, val_fraction=0.2, seed=3, cache=cache)
    assert "preparing" in capfd.readouterr().err
    assert (first.num_train, first.num_val) == (48, 12)
    stored = data_set_messages(first.path)
    assert len(stored) == CHATS and not list(cache.glob(".partial-*"))
    by_line = {int(key[4:]): messages for key, messages in stored.items()}  # line000000001
    for line, messages in by_line.items():
        i = line - 1
        system = f"system {i}" if i % 2 else "Be terse."  # the record's own, or the fixed one
        assert messages == [{"role": "system", "content": system}, *chats[i]]
    # the same file and settings: the same folder, nothing prepared again
    again = prepared_data_set(source, shape, val_fraction=0.2, seed=3, cache=cache)
    assert again == first and "preparing" not in capfd.readouterr().err
    # what decides the content decides the folder: the split's seed, the shape, the bytes
    assert prepared_data_set(source, shape, val_fraction=0.2, seed=4, cache=cache) != first
    other_shape = RecordShape(chat_key="conversation")
    assert prepared_data_set(source, other_shape, val_fraction=0.2, seed=3, cache=cache) != first
    with source.open("a") as f:
        f.write(json.dumps({"conversation": chats[0]}) + "\n")
    assert prepared_data_set(source, shape, val_fraction=0.2, seed=3, cache=cache) != first


def test_a_response_dataset_reads_its_input_and_output_keys(tmp_path):
    source = tmp_path / "qa.jsonl"
    source.write_text(
        "".join(json.dumps({"q": f"question {i}", "a": f"answer {i}"}) + "\n" for i in range(5))
    )
    shape = RecordShape(dataset_name="ResponseDataset", input_key="q", output_key="a")
    got = prepared_data_set(source, shape, cache=tmp_path / "cache")
    stored = data_set_messages(got.path)
    assert stored["line000000003"] == [
        {"role": "user", "content": "question 2"},
        {"role": "assistant", "content": "answer 2"},
    ]


def test_a_preparation_cut_short_is_never_taken_for_a_complete_one(tmp_path, monkeypatch):
    source = tmp_path / "chats.jsonl"
    _openai_lines(source, 10)
    shape, cache = RecordShape(chat_key="conversation"), tmp_path / "cache"
    import sft_runtime.runtime.data.prepare as prepare

    real = prepare.energon_prepare

    def dies(*args, **kwargs):  # after the shards are written, before the index
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "energon_prepare", dies)
    with pytest.raises(KeyboardInterrupt):
        prepared_data_set(source, shape, cache=cache)
    assert [p.name for p in cache.iterdir()] == []  # no folder, complete or partial
    monkeypatch.setattr(prepare, "energon_prepare", real)
    got = prepared_data_set(source, shape, cache=cache)
    assert got.num_train == 10 and (got.path / ".nv-meta").is_dir()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"conversation": "hi"}, "chats.jsonl:1: 'conversation' must be a list of messages"),
        (
            {"conversation": [{"role": "user", "content": "x"}], "tools": {"name": "f"}},
            "chats.jsonl:1: 'tools' must be a list of tool definitions",
        ),
        (
            {"conversation": [{"role": "assistant", "content": "", "tool_calls": [{"id": 1}]}]},
            "chats.jsonl:1: conversation[0].tool_calls[0].function must be an object",
        ),
        ({"conversation": [{"role": "user", "content": "x"}]}, "no assistant"),
    ],
)
def test_a_bad_line_is_named_before_anything_starts(tmp_path, line, message):
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps(line) + "\n")
    raw = _nemo_rl_raw(tmp_path, source, 2, split_validation_size=0.0)
    raw["sft"]["val_period"] = 0
    config = validate_config(raw)
    with pytest.raises(UserInputError) as info:
        bring_data(config, cache=tmp_path / "cache")
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("train", "message"),
    [
        (
            {"dataset_name": "squad", "data_path": None},
            "data.train.dataset_name 'squad': a hub data set cannot be fetched here; bring it "
            "as a local JSONL file",
        ),
        ({"dataset_name": None}, "data.train.data_path needs data.train.dataset_name"),
        ({"path": "/x"}, "name two sources; keep one"),
    ],
)
def test_bad_data_keys_are_one_line_naming_the_key(tmp_path, train, message):
    raw = _nemo_rl_raw(tmp_path, tmp_path / "chats.jsonl", 2, **train)
    raw["data"]["train"] = {k: v for k, v in raw["data"]["train"].items() if v is not None}
    with pytest.raises(UserInputError) as info:
        validate_config(raw)
    assert message in str(info.value), str(info.value)


def test_one_epoch_is_one_pass_over_the_train_split(tmp_path):
    source = tmp_path / "chats.jsonl"
    _openai_lines(source)
    raw = _nemo_rl_raw(tmp_path, source, 100)
    brought = bring_data(validate_config(raw), cache=tmp_path / "cache")
    assert brought.data.train.virtual_epoch_length == 48 // 8  # whole global batches
    assert brought.data.validation.split == "val"
    assert brought.data.validation.path == brought.data.train.path
    raw["policy"]["sequence_packing"] = {"enabled": True}  # the batch counts conversations
    packed = bring_data(validate_config(raw), cache=tmp_path / "cache")
    assert packed.data.train.virtual_epoch_length == 48 // 8


def test_a_run_on_a_nemo_rl_data_file_trains_validates_and_resumes_exactly(
    ray_session, tmp_path, monkeypatch, capsys
):
    """The CLI on a config file whose data is a JSONL file: 4 steps with validation, then
    the same command for 6 resumes from its last checkpoint (nothing prepared again)
    and agrees bit for bit with an uninterrupted 6-step run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source = tmp_path / "chats.jsonl"
    _openai_lines(source)
    runs = {}
    for name, budgets in (("resumed", (4, 6)), ("straight", (6,))):
        raw = _nemo_rl_raw(tmp_path / name, source, budgets[0])
        config_file = tmp_path / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump(raw))
        for budget in budgets:
            assert main(["train", str(config_file), f"sft.max_num_steps={budget}"]) == 0
        runs[name] = tmp_path / name / "run"
    err = capsys.readouterr().err
    assert err.count("preparing") == 1, err  # one cache for the three launches
    resumed, straight = (step_facts(runs[k]) for k in ("resumed", "straight"))
    assert sorted(resumed) == list(range(1, 7)) and resumed == straight
    records = list(read_log(runs["resumed"]))
    started = [r.data["resumed_from_step"] for r in records if r.type == "run_started"]
    assert started == [None, 4]
    validated = [r for r in records if r.type == "validation_completed"]
    assert [r.data["samples"] for r in validated] == [4, 4, 4], validated

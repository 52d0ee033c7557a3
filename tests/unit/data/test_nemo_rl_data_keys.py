"""NeMo RL's data keys as the config reads them: data.default fills the entries, split and
validation: null are accepted, data.num_workers is the one name for the loader's workers,
data.energon is optional with data.shuffle deciding the shuffle buffer, and every value
that asks for what is not built is one line naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from sft_runtime.runtime.config import MasterConfig, loader_spec, validate_config
from sft_runtime.runtime.config_files.overrides import apply_override
from sft_runtime.runtime.data.chat_format import ChatFormat, with_prompt
from sft_runtime.runtime.data.config import DEFAULT_SHUFFLE_BUFFER
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.resume.config_change import config_changes
from sft_runtime.runtime.resume.config_keys import config_leaves, flatten
from sft_runtime.runtime.validation.config import validation_spec
from tests.support.small_run import small_raw


def _raw(*overrides: str, data_file: bool = False) -> dict:
    raw = small_raw(Path("/tmp/run"), Path("/tmp/data"))
    if data_file:  # NeMo RL's shape: a local file named by dataset_name and data_path
        raw["data"]["train"] = {"dataset_name": "openai_format", "data_path": "/tmp/t.jsonl"}
    for item in overrides:
        apply_override(raw, item)
    return raw


def _as_prepared(config: MasterConfig) -> MasterConfig:
    """`config` as bring.py leaves it once its data file is prepared (no file read here)."""
    prepared = {"path": "/tmp/prepared", "dataset_name": None, "data_path": None}
    train = config.data.train.model_copy(update={**prepared, "virtual_epoch_length": 4})
    return config.model_copy(update={"data": config.data.model_copy(update={"train": train})})


def _refusal(raw: dict) -> str:
    """The one problem line a refused config gives."""
    with pytest.raises(UserInputError) as err:
        validate_config(raw)
    problems = str(err.value).splitlines()[1:]
    assert len(problems) == 1, problems
    return problems[0]


def test_nemo_rls_data_section_reads_as_given():
    config = validate_config(
        _raw(
            "++data.add_bos=true",
            "++data.add_eos=true",
            "++data.add_generation_prompt=false",
            "++data.shuffle=true",
            "++data.num_workers=1",
            "++data.default.processor=sft_processor",
            "++data.default.prompt_file=null",
            "++data.default.system_prompt_file=null",
            "++data.train.split=train",
            "++data.validation.dataset_name=openai_format",
            "++data.validation.data_path=/tmp/v.jsonl",
            "++data.validation.split=validation",
            data_file=True,
        )
    )
    data = config.data
    assert data.chat_format == ChatFormat(add_bos=True, add_eos=True, add_generation_prompt=False)
    assert data.num_workers == 1 and data.shuffle
    assert data.train.split == "train" and data.validation.split == "validation"
    assert "default" not in config.model_dump()["data"]  # applied to the entries, then gone
    spec = loader_spec(_as_prepared(config), 2)
    assert spec.chat_format == data.chat_format and spec.num_workers == 1 and spec.shuffle


def test_data_default_fills_what_an_entry_leaves_out(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Question: {}\nAnswer briefly.")
    other = tmp_path / "other.txt"
    other.write_text("Q: {}")
    raw = _raw(
        "++data.default.dataset_name=ResponseDataset",
        "++data.default.input_key=question",
        f"++data.default.prompt_file={prompt}",
        "++data.default.split_validation_size=0.1",  # a key only the train entry has
        "++data.validation.data_path=/tmp/v.jsonl",
        f"++data.validation.prompt_file={other}",  # the entry's own value wins
        data_file=True,
    )
    raw["data"]["train"].pop("dataset_name")
    data = validate_config(raw).data
    assert data.train.dataset_name == data.validation.dataset_name == "ResponseDataset"
    assert data.train.input_key == data.validation.input_key == "question"
    assert data.train.prompt_file == str(prompt) and data.validation.prompt_file == str(other)
    assert data.train.split_validation_size == 0.1
    spec = loader_spec(_as_prepared(validate_config(raw)), 1)
    assert spec.prompt == "Question: {}\nAnswer briefly."
    # validation: null stays null; default fills nothing there
    nulled = _raw("++data.default.input_key=question", "++data.validation=null", data_file=True)
    assert validate_config(nulled).data.validation is None


def test_the_prompt_file_formats_the_first_user_message():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3 + 3?"},
    ]
    out = with_prompt(messages, "Q: {}\nA:")
    assert out[1] == {"role": "user", "content": "Q: 2 + 2?\nA:"}
    assert out[0] == messages[0] and out[2:] == messages[2:]
    assert messages[1]["content"] == "2 + 2?"  # the sample itself is left alone
    assert with_prompt(messages, None) is messages


def test_validation_takes_its_own_entrys_prompt(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("V: {}")
    raw = _raw(
        "++data.validation.dataset_name=openai_format",
        "++data.validation.data_path=/tmp/v.jsonl",  # prepared before Ray, not read here
        f"++data.validation.prompt_file={prompt}",
        "++data.add_generation_prompt=false",
        "sft.val_period=2",
    )
    config = validate_config(raw)
    prepared = {"path": "/tmp/prepared", "dataset_name": None, "data_path": None}
    config.data.validation = config.data.validation.model_copy(update=prepared)
    spec = validation_spec(config)
    assert spec.prompt == "V: {}" and not spec.chat_format.add_generation_prompt


def test_energon_is_optional_and_shuffle_decides_its_buffer():
    raw = _raw()
    del raw["data"]["energon"]
    data = validate_config(raw).data
    assert data.shuffle and data.energon.shuffle_buffer_size == DEFAULT_SHUFFLE_BUFFER
    apply_override(raw, "++data.shuffle=false")
    data = validate_config(raw).data
    assert not data.shuffle and data.energon.shuffle_buffer_size is None
    # an explicit size, or an explicit null, is taken as given
    sized = validate_config(_raw("data.energon.shuffle_buffer_size=32")).data.energon
    assert sized.shuffle_buffer_size == 32
    assert validate_config(_raw()).data.energon.shuffle_buffer_size is None  # small_raw's null
    line = _refusal(_raw("++data.shuffle=false", "data.energon.shuffle_buffer_size=32"))
    assert "data.energon.shuffle_buffer_size" in line and "data.shuffle" in line


def test_energons_num_workers_is_refused_naming_data_num_workers():
    line = _refusal(_raw("++data.energon.num_workers=1"))
    assert "data.energon.num_workers" in line and "data.num_workers" in line


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("++data.default.processor=math_hf_data_processor", "data.default.processor"),
        ("++data.train.processor=math_hf_data_processor", "data.train.processor"),
        ("++data.default.system_prompt_file=/tmp/system.txt", "data.default.system_prompt_file"),
        ("++data.train.system_prompt_file=/tmp/system.txt", "data.train.system_prompt_file"),
        ("++data.default.prompt_file=/no/such/prompt.txt", "data.default.prompt_file"),
        ("++data.default.shuffle_buffer=8", "data.default.shuffle_buffer"),
        ("data.train.dataset_name=squad", "data.train.dataset_name"),
        ("++data.validation.dataset_name=squad", "data.validation.dataset_name"),
    ],
)
def test_what_is_not_built_is_one_line_naming_the_key(override, key):
    validation = ("++data.validation.dataset_name=openai_format", "++data.validation.data_path=x")
    raw = _raw(*validation, override, data_file=True)
    if key == "data.validation.dataset_name":
        raw["data"]["validation"].pop("data_path")
    line = _refusal(raw)
    assert key in line


@pytest.mark.parametrize(
    ("text", "why"),
    [("No placeholder.", "no {}"), ("Q: {question}", "KeyError"), ("{} and {}", "IndexError")],
)
def test_a_prompt_file_that_cannot_hold_the_message_is_refused(tmp_path, text, why):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    line = _refusal(_raw(f"++data.default.prompt_file={prompt}", data_file=True))
    assert "data.default.prompt_file" in line and why in line


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("data.add_bos", "true"),
        ("data.add_eos", "false"),
        ("data.add_generation_prompt", "false"),
        ("data.shuffle", "false"),
        ("data.num_workers", "1"),
    ],
)
def test_a_resume_with_another_value_is_a_change_of_what_steps_compute(key, value):
    leaves = config_leaves()
    old = flatten(validate_config(_raw()).model_dump(mode="json"), leaves)
    new = flatten(validate_config(_raw(f"++{key}={value}")).model_dump(mode="json"), leaves)
    changes = config_changes(old, {}, new, {})
    assert [c.key for c in changes] == [key]
    assert changes[0].kind == "compute"


def test_a_checkpoint_config_without_the_keys_reads_as_their_defaults():
    """A config.yaml written before these keys existed: what it lacks counts as the default,
    so a resume under the defaults sees no change (the loader fingerprint still compares
    the rows themselves)."""
    leaves = config_leaves()
    dumped = validate_config(_raw()).model_dump(mode="json")
    for key in ("add_bos", "add_eos", "add_generation_prompt", "shuffle", "num_workers"):
        del dumped["data"][key]
    new = flatten(validate_config(_raw()).model_dump(mode="json"), leaves)
    assert config_changes(flatten(dumped, leaves), {}, new, {}) == []

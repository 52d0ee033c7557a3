"""NeMo RL's data keys on real energon loaders: data.shuffle's order, rows under
add_bos / add_eos / add_generation_prompt and a prompt_file, the loader fingerprint that
refuses a state saved under other rows or order, and data files named as NeMo RL names them
(``split``, ``validation: null``) prepared by the run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sft_runtime.runtime.config import validate_config
from sft_runtime.runtime.data.bring import bring_data
from sft_runtime.runtime.data.chat_format import ChatFormat
from sft_runtime.runtime.data.config import DEFAULT_SHUFFLE_BUFFER
from sft_runtime.runtime.data.demo import demo_conversation
from sft_runtime.runtime.data.loader import LoaderStateMismatchError
from sft_runtime.runtime.data.tokenizer import TokenizerSpec, build_tokenizer
from tests.support.fixtures import NUM_SAMPLES, data_set_messages
from tests.support.nemo_rl_rows import BARE_TEMPLATE, nemo_rl_row
from tests.support.small_run import small_raw

BATCH = 4  # make_loader's batch size
# Overlong samples keep their place (cut, weighted zero) instead of being skipped when
# truncation leaves them nothing to learn, so every stored sample is read.
ALL = {"overlong_samples": "mask"}


def _read(loader, batches: int) -> list[str]:
    out: list[str] = []
    for _ in range(batches):
        out += loader.load().source_ids
        loader.commit()
    return out


def test_without_shuffle_each_epoch_is_the_stored_order(make_loader, demo_dataset):
    stored = list(data_set_messages(demo_dataset))  # key order of the shards, as written
    loader = make_loader(shuffle=False, shuffle_buffer_size=None, **ALL)
    per_epoch = NUM_SAMPLES // BATCH
    got = _read(loader, per_epoch + 5)
    assert got[:NUM_SAMPLES] == stored
    assert got[NUM_SAMPLES:] == stored[: 5 * BATCH]  # the next epoch: the same order again


def test_without_shuffle_two_ranks_read_their_own_ranges_in_order(make_loader, demo_dataset):
    stored = list(data_set_messages(demo_dataset))
    first = _read(make_loader(shuffle=False, shuffle_buffer_size=None, rank=0, world=2, **ALL), 6)
    second = _read(make_loader(shuffle=False, shuffle_buffer_size=None, rank=1, world=2, **ALL), 6)
    assert first == stored[: len(first)]
    half = NUM_SAMPLES // 2
    assert second == stored[half : half + len(second)]


def test_energons_shuffle_without_a_buffer_is_a_permutation_per_epoch(make_loader, demo_dataset):
    """With ``shuffle: true`` and no buffer energon still shuffles: shard slices in a new
    seeded order each epoch, drawn from at random; every sample once an epoch."""
    stored = list(data_set_messages(demo_dataset))
    got = _read(make_loader(shuffle_buffer_size=None, **ALL), 2 * NUM_SAMPLES // BATCH)
    first, second = got[:NUM_SAMPLES], got[NUM_SAMPLES:]
    assert sorted(first) == sorted(second) == sorted(stored)
    assert first != stored and second != first


def test_the_default_buffer_shuffles_and_resumes_exactly(make_loader, demo_dataset):
    stored = list(data_set_messages(demo_dataset))
    straight = _read(make_loader(shuffle_buffer_size=DEFAULT_SHUFFLE_BUFFER), 12)
    assert straight != stored[: len(straight)]
    loader = make_loader(shuffle_buffer_size=DEFAULT_SHUFFLE_BUFFER)
    head = _read(loader, 5)
    resumed = make_loader(shuffle_buffer_size=DEFAULT_SHUFFLE_BUFFER, state=loader.state_dict())
    assert head + _read(resumed, 7) == straight


@pytest.mark.parametrize(
    ("saved", "restored", "named"),
    [
        ({"shuffle": False, "shuffle_buffer_size": None}, {"shuffle_buffer_size": None}, "shuffle"),
        ({}, {"chat_format": ChatFormat(add_generation_prompt=False)}, "chat_format"),
        ({}, {"prompt": "Q: {}"}, "prompt"),
    ],
    ids=["shuffle", "add_generation_prompt", "prompt_file"],
)
def test_a_state_saved_under_other_rows_or_order_is_refused(make_loader, saved, restored, named):
    first = make_loader(**saved)
    _read(first, 2)
    with pytest.raises(LoaderStateMismatchError, match=named):
        make_loader(**restored, state=first.state_dict())


def test_a_format_that_changes_no_row_restores(make_loader):
    """The byte layout already has BOS and EOS: add_bos and add_eos change none of its rows,
    so a state saved before the keys existed (the legacy format) restores under them."""
    header_as_context = {"add_generation_prompt": True}
    first = make_loader(chat_format=ChatFormat(add_bos=False, add_eos=False, **header_as_context))
    head = _read(first, 2)
    again = make_loader(chat_format=ChatFormat(add_bos=True, add_eos=True, **header_as_context))
    rest = make_loader(
        chat_format=ChatFormat(add_bos=True, **header_as_context), state=first.state_dict()
    )
    assert head + _read(rest, 2) == _read(again, 4)


def test_rows_follow_nemo_rls_rules_and_the_prompt_file(make_loader, demo_messages, tiny_llama):
    spec = TokenizerSpec(name=str(tiny_llama), chat_template=BARE_TEMPLATE)
    hf = build_tokenizer(spec).hf_tokenizer
    fmt = ChatFormat(add_bos=True, add_eos=True, add_generation_prompt=False)
    prompt = "Task: {}\nAnswer:"
    loader = make_loader(
        tokenizer=spec, chat_format=fmt, prompt=prompt, max_input_seq_length=1024, pad_multiple=1
    )
    for _ in range(3):
        loader.load()
        batch = loader.active_batch
        for r, key in enumerate(batch.source_ids):
            want_ids, want_mask = nemo_rl_row(
                hf, BARE_TEMPLATE, demo_messages[key], prompt=prompt, **fmt.model_dump()
            )
            n = len(want_ids)
            assert batch.input_ids[r, :n].tolist() == want_ids
            assert batch.loss_mask[r, :n].tolist() == want_mask
        loader.commit()


def _chats(path: Path, count: int) -> Path:
    rng = random.Random(5)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"messages": demo_conversation(rng)}) + "\n")
    return path


def test_nemo_rls_split_names_and_a_null_validation_are_taken(tmp_path):
    """``split: validation`` names a local file's only split; ``validation: null`` with
    ``split_validation_size`` holds out the train file's share, read with its prompt file."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Please: {}")
    raw = small_raw(tmp_path / "run", tmp_path / "unused")
    raw["data"]["default"] = {"dataset_name": "openai_format", "prompt_file": str(prompt)}
    raw["data"]["train"] = {
        "data_path": str(_chats(tmp_path / "train.jsonl", 40)),
        "split": "validation",
        "split_validation_size": 0.25,
    }
    raw["data"]["validation"] = None
    config = bring_data(validate_config(raw), cache=tmp_path / "cache")
    train, validation = config.data.train, config.data.validation
    assert train.split == "train" and train.data_path is None
    assert validation.path == train.path and validation.split == "val"
    assert validation.prompt_file == str(prompt)
    assert len(data_set_messages(Path(train.path))) == 40

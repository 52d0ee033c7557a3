"""Tool calling end to end: an openai_format JSONL file with tools, calls and tool results is
prepared by the run itself into an energon data set that stores each conversation's tools,
trained on by real Ray workers, and ``sft-runtime samples`` shows every sample trained as
transformers' ``return_assistant_tokens_mask`` marks it on a ``{% generation %}`` version of
the template: the calls supervised, the tool results and definitions context. The byte
tokenizer refuses such a file naming its line, and a template's refusal is a bad line."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.config import validate_config
from sft_runtime.runtime.data.bring import bring_data, prepared_data_set
from sft_runtime.runtime.data.chat_format import ChatFormat, uses_tools
from sft_runtime.runtime.data.record_shapes import RecordShape
from sft_runtime.runtime.data.records import BadRecordError, parse_line
from sft_runtime.runtime.data.tokenizer import TokenizerSpec
from sft_runtime.runtime.errors import UserInputError
from tests.support.small_run import small_raw
from tests.support.tool_chats import TOOL_TEMPLATE, TOOL_TEMPLATE_MARKED, tool_records, tool_texts

pytest.importorskip("transformers")

CHATS = 24  # three global batches of 8
SEQ = 512  # longer than any conversation here: none is cut
PLAIN = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hey."}]}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture(scope="module")
def records() -> list[dict]:
    """Two conversations without tools, then tool-calling ones (line 3 the first)."""
    rows = [PLAIN, PLAIN, *tool_records(CHATS - 2, seed=5)]
    assert uses_tools(rows[2]["messages"], rows[2].get("tools"))
    return rows


@pytest.fixture(scope="module")
def tiny_tools_model(tmp_path_factory) -> Path:
    """A hub-like folder: a ChatML tokenizer (its BPE learned on the tool chats too) beside
    a two-layer Qwen2 that takes rows of `SEQ` tokens."""
    from tests.support.hf_models import build_model, demo_texts, train_tokenizer

    folder = tmp_path_factory.mktemp("hf") / "tiny-tools"
    tok = train_tokenizer(folder, demo_texts() + tool_texts(), template="chatml", vocab_size=1024)
    build_model(
        folder,
        family="qwen2",
        vocab_size=len(tok),
        max_positions=2 * SEQ,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return folder


def _config(tmp_path: Path, data_file: Path, model: Path | None, steps: int = 2) -> dict:
    """A small run on `data_file` (openai_format), with every value the test relies on
    pinned: float32 without FSDP, 8 conversations a step, rows as the template renders
    them (no BOS added, EOS present, headers as context), no worker processes."""
    raw = small_raw(tmp_path / "run", tmp_path / "unused", steps)
    raw["data"].update(
        train={"dataset_name": "openai_format", "data_path": str(data_file)},
        max_input_seq_length=SEQ,
        overlong_samples="mask",
        add_bos=False,
        add_eos=True,
        add_generation_prompt=True,
        num_workers=0,
        shuffle=False,
    )
    raw["policy"].update(
        precision="float32",
        dtensor_cfg={"enabled": False},
        train_global_batch_size=8,
        train_micro_batch_size=2,
        sequence_packing={"enabled": False},
        make_sequence_length_divisible_by=8,
    )
    raw["sft"].update(val_period=0, val_at_start=False, val_at_end=False)
    raw["checkpointing"].update(enabled=True, save_period=1, keep_top_k=None)
    raw["policy"]["model"]["max_seq_len"] = SEQ  # the built-in model's, unused with a model
    if model is not None:
        raw["policy"].update(
            model_name=str(model),
            tokenizer={"name": str(model), "chat_template": TOOL_TEMPLATE},
            max_total_sequence_length=SEQ,
        )
    return raw


def _stored(folder: Path) -> dict[str, dict]:
    """A prepared data set's samples straight from its tars: key -> stored record."""
    out = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                if ext == "json":
                    out[key] = json.loads(tar.extractfile(member).read())
    return out


def test_a_file_with_tools_is_prepared_with_them_and_its_tools_decide_the_folder(tmp_path, records):
    source = _write(tmp_path / "tools.jsonl", records)
    cache = tmp_path / "cache"
    got = prepared_data_set(source, RecordShape(), cache=cache)
    assert (got.num_train, got.tool_line) == (CHATS, 3)
    assert "tools: json[tools]" in (got.path / ".nv-meta" / "dataset.yaml").read_text()
    stored = _stored(got.path)
    for line, record in enumerate(records, start=1):
        chat = parse_line(json.dumps(record), source="x", line_no=line, shape=RecordShape())
        assert stored[f"line{line:09d}"] == {"messages": chat.messages, "tools": chat.tools}
    # tools are content: another definition in one line is another file, another folder
    edited = json.loads(json.dumps(records))
    first = next(r for r in edited if r.get("tools"))
    first["tools"][0]["function"]["description"] = "Today's weather in a city."
    again = prepared_data_set(_write(tmp_path / "tools.jsonl", edited), RecordShape(), cache=cache)
    assert again.path != got.path and again.tool_line == 3
    assert "Today's weather" in json.dumps(_stored(again.path))
    # a file without tools is stored as before: no tools field, no line
    plain_file = _write(tmp_path / "plain.jsonl", [PLAIN] * 3)
    plain = prepared_data_set(plain_file, RecordShape(), cache=cache)
    assert plain.tool_line is None
    assert "tools" not in (plain.path / ".nv-meta" / "dataset.yaml").read_text()
    assert list(_stored(plain.path).values())[0] == PLAIN


def test_the_loader_renders_each_sample_with_its_stored_tools(
    tmp_path, records, tiny_tools_model, make_loader
):
    from transformers import AutoTokenizer

    got = prepared_data_set(_write(tmp_path / "t.jsonl", records), RecordShape(), cache=tmp_path)
    spec = TokenizerSpec(name=str(tiny_tools_model), chat_template=TOOL_TEMPLATE)
    fmt = ChatFormat(add_bos=False, add_eos=True, add_generation_prompt=True)
    loader = make_loader(
        data_path=str(got.path),
        tokenizer=spec,
        chat_format=fmt,
        shuffle=False,
        shuffle_buffer_size=None,
        max_input_seq_length=SEQ,
        pad_multiple=1,
        batch_size=8,
    )
    hf = AutoTokenizer.from_pretrained(str(tiny_tools_model))
    seen = 0
    for _ in range(2):
        loader.load()
        batch = loader.active_batch
        for row, key in enumerate(batch.source_ids):
            ids, mask = _reference(hf, records[int(key[4:]) - 1])
            assert batch.input_ids[row, : len(ids)].tolist() == ids
            assert batch.loss_mask[row, : len(ids)].tolist() == [0.0] + mask[1:]
            seen += 1
        loader.commit()
    assert seen == 16


def _reference(hf, record: dict) -> tuple[list[int], list[float]]:
    """transformers' ids and assistant mask of `record` on the marked template."""
    chat = parse_line(json.dumps(record), source="x", line_no=1, shape=RecordShape())
    own = hf.apply_chat_template(
        chat.messages,
        tools=chat.tools,
        chat_template=TOOL_TEMPLATE_MARKED,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(own["input_ids"]), [float(m) for m in own["assistant_masks"]]


def test_the_byte_tokenizer_refuses_a_tool_file_naming_the_line(tmp_path, records):
    source = _write(tmp_path / "chats.jsonl", records)
    config = validate_config(_config(tmp_path, source, model=None))
    assert config.policy.tokenizer.is_byte
    with pytest.raises(UserInputError) as info:
        bring_data(config, cache=tmp_path / "cache")
    message = str(info.value)
    assert message.startswith(f"{source}:3: tool calling needs a Hugging Face tokenizer")
    assert len(message.splitlines()) == 1
    # the same file without its tool lines trains with it
    _write(source, records[:2] * 4)
    assert bring_data(config, cache=tmp_path / "cache").data.train.path is not None


def test_a_line_the_template_refuses_is_a_bad_line_of_prepare_data(tmp_path, records, capsys):
    """Qwen3's stock template reads every assistant's content, so a call with ``content:
    null`` is refused when prepare-data renders the file (tools and all); --skip-bad skips
    it, as any bad line."""
    from tests.support.hf_models import demo_texts, train_tokenizer

    qwen3 = tmp_path / "qwen3"
    train_tokenizer(qwen3, demo_texts(50), template="qwen3")
    silent = next(
        i for i, r in enumerate(records) if any(m.get("content", 0) is None for m in r["messages"])
    )
    fixed = []
    for i, record in enumerate(records):
        messages = [{**m, "content": m.get("content") or ""} for m in record["messages"]]
        fixed.append(record if i == silent else {**record, "messages": messages})
    source = _write(tmp_path / "chats.jsonl", fixed)
    args = ["prepare-data", str(source), "--tokenizer", str(qwen3)]
    assert main([*args, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{source}:{silent + 1}: the chat template refuses this conversation" in err
    assert main([*args, str(tmp_path / "skipped"), "--skip-bad"]) == 0
    assert f"skipped 1 bad line(s): {silent + 1}" in capsys.readouterr().out
    with pytest.raises(BadRecordError, match=r"chats.jsonl:4: 'tools' must be a list"):
        bad = [*fixed[:3], {**fixed[3], "tools": "get_weather"}]
        prepared_data_set(_write(source, bad), RecordShape(), cache=tmp_path / "cache")


def test_a_run_trains_the_calls_and_not_the_tool_results(
    ray_session, tmp_path, records, tiny_tools_model, monkeypatch, capsys
):
    """Two steps of the real CLI on the JSONL file with real Ray workers; `samples` then
    shows every sample of a step trained on exactly what the generation blocks mark."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source = _write(tmp_path / "chats.jsonl", records)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(_config(tmp_path, source, tiny_tools_model)))
    assert main(["train", str(config_file)]) == 0
    capsys.readouterr()

    rows = []
    for step in (1, 2):  # step 1 read again from the run's start, step 2 from step 1's save
        assert main(["samples", str(tmp_path / "run"), "--step", str(step), "--json"]) == 0
        rows += json.loads(capsys.readouterr().out)
    hf = AutoTokenizer.from_pretrained(str(tiny_tools_model))
    seen, calls, results = 0, 0, 0
    for row in rows:
        for sample in row["samples"]:
            record = records[int(sample["source_id"][4:]) - 1]
            ids, mask = _reference(hf, record)
            assert sample["token_ids"] == ids
            assert sample["supervised"] == [int(m) for m in mask]
            text = sample["text"]  # supervised runs shown [[like this]]
            supervised = "".join(part.split("]]")[0] for part in text.split("[[")[1:])
            context = "".join(part.split("]]")[-1] for part in text.split("[["))
            assert "<tool_response>" not in supervised and "# Tools" not in supervised
            calls += supervised.count("<tool_call>")
            results += context.count("<tool_response>")
            seen += 1
    assert seen == 16 and calls > 0 and results > 0

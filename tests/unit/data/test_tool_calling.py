"""Tool calling in NeMo RL's openai_format data: read, checked and rendered as NeMo RL does.

A record's ``tools`` and its messages' ``tool_calls`` and ``tool`` results reach the chat
template as ``apply_chat_template(messages, tools=tools)``. Supervision is the assistant's:
its calls are trained on like any reply, the tool results and the tool definitions the
template writes into the system block are context, token for token what transformers'
``return_assistant_tokens_mask`` marks on a ``{% generation %}`` version of the same
template. Bad tool data is one line naming the file and line; the byte tokenizer, which has
no layout for tools, refuses them.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest

from sft_runtime.runtime.data.chat_format import BYTE_REFUSAL, ChatFormat
from sft_runtime.runtime.data.record_shapes import RecordShape
from sft_runtime.runtime.data.records import BadRecordError, Conversation, parse_line
from sft_runtime.runtime.data.sample import ChatSample
from sft_runtime.runtime.data.task_encoder import SFTTaskEncoder
from sft_runtime.runtime.data.tokenizer import ByteTokenizer, TokenizerSpec, build_tokenizer
from tests.support.hf_models import demo_texts, train_tokenizer
from tests.support.tool_chats import (
    TOOL_TEMPLATE,
    TOOL_TEMPLATE_MARKED,
    TOOLS,
    tool_records,
    tool_texts,
)

pytest.importorskip("transformers")

SOURCE = "data/chats.jsonl"
# Rows as the template renders them, headers as context: what the generation blocks mark.
RENDERED = ChatFormat(add_bos=False, add_eos=True, add_generation_prompt=True)
RECORDS = tool_records(24, seed=3)
KINDS = {  # one of each kind the records draw (tests/support/tool_chats.py)
    "weather": 0,
    "sum": next(i for i, r in enumerate(RECORDS) if r["messages"][0]["role"] == "system"),
    "two_results": next(i for i, r in enumerate(RECORDS) if len(r["messages"]) == 7),
    "no_call": next(i for i, r in enumerate(RECORDS) if len(r["messages"]) == 2),
}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ],
}
CHAT = [
    {"role": "user", "content": "Weather in Oslo?"},
    CALL,
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "rainy"},
    {"role": "assistant", "content": "It is rainy in Oslo."},
]


def _read(record: dict, shape: RecordShape | None = RecordShape()) -> Conversation:
    """`record` as line 7 of `SOURCE` (read in `shape`; None: as a prepared sample)."""
    return parse_line(json.dumps(record), source=SOURCE, line_no=7, shape=shape)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A ChatML tokenizer whose BPE merges learned the tool conversations too."""
    out = tmp_path_factory.mktemp("tools") / "tok"
    train_tokenizer(out, demo_texts(100) + tool_texts(), template="chatml")
    return str(out)


@functools.cache
def _ours(folder: str, template: str | None = TOOL_TEMPLATE, kwargs: tuple = ()):
    spec = TokenizerSpec(
        name=folder, chat_template=template or "default", chat_template_kwargs=dict(kwargs) or None
    )
    return build_tokenizer(spec)


def _reference(tok, conversation: Conversation) -> tuple[list[int], list[bool]]:
    """transformers' own ids and assistant mask, from the template's generation blocks."""
    own = tok.hf_tokenizer.apply_chat_template(
        conversation.messages,
        tools=conversation.tools,
        chat_template=TOOL_TEMPLATE_MARKED,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(own["input_ids"]), [bool(m) for m in own["assistant_masks"]]


def _runs(tok, ids: list[int], mask: list[bool], keep: bool = True) -> list[str]:
    """The tokens whose mask is `keep`, decoded, one string per maximal run."""
    runs: list[list[int]] = []
    previous = not keep
    for token, flag in zip(ids, mask, strict=True):
        if flag == keep and previous != keep:
            runs.append([])
        if flag == keep:
            runs[-1].append(token)
        previous = flag
    return [tok.hf_tokenizer.decode(run) for run in runs]


# ------------------------------------------------------------------------- reading records
def test_openai_records_keep_tools_calls_and_results_as_given():
    """NeMo RL's record under its own keys: the tools go beside the messages, a call keeps
    its arguments as written (an object, or a JSON string), a result its id and name;
    OpenAI's other optional keys are dropped as before."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"function": {"name": "get_weather", "arguments": {"city": "Lima"}}},
    ]
    record = {
        "conversation": [
            {"role": "user", "content": "Go.", "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": calls, "refusal": None},
            {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "1"},
            {"role": "tool", "tool_call_id": None, "content": ""},  # an empty result is one
            {"role": "assistant", "content": "Done."},
        ],
        "functions": TOOLS,
        "id": 12,
    }
    shape = RecordShape(chat_key="conversation", tool_key="functions", system_prompt="Be brief.")
    chat = _read(record, shape=shape)
    assert chat.tools == TOOLS and chat.uses_tools
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Go."},
        {"role": "assistant", "tool_calls": calls},  # null content left out, as transformers does
        {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "1"},
        {"role": "tool", "content": ""},
        {"role": "assistant", "content": "Done."},
    ]
    assert _read({"messages": chat.messages, "tools": chat.tools}, shape=None) == chat  # stored
    assert _read(record, shape=RecordShape(chat_key="conversation", tool_key=None)).tools is None


@pytest.mark.parametrize("empty", [None, []], ids=["null", "empty"])
def test_an_empty_tools_list_or_calls_list_is_no_tools_as_before(empty):
    """Such records were accepted before tool calling was read (the keys were dropped):
    they read as they did, so a data file prepared then keeps its cached folder."""
    plain = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    messages = [plain[0], {**plain[1], "tool_calls": empty}]
    chat = _read({"messages": messages, "tools": empty})
    assert chat == Conversation(plain) and not chat.uses_tools


BAD = {
    "tools_not_a_list": ({"tools": {"name": "add"}}, "'tools' must be a list of tool definitions"),
    "a_tool_not_an_object": ({"tools": ["add"]}, "tools[0] must be an object"),
    "calls_not_a_list": ({"calls": {"name": "add"}}, "messages[1].tool_calls must be a list"),
    "no_function": ({"calls": [{"type": "function"}]}, "tool_calls[0].function must be an object"),
    "no_name": (
        {"calls": [{"function": {"arguments": {}}}]},
        "messages[1].tool_calls[0].function.name must be a non-empty string",
    ),
    "arguments_not_json": (
        {"calls": [{"function": {"name": "add", "arguments": "{a: 1}"}}]},
        "messages[1].tool_calls[0].function.arguments is not JSON (Expecting property name",
    ),
    "arguments_not_an_object": (
        {"calls": [{"function": {"name": "add", "arguments": "[1, 2]"}}]},
        "tool_calls[0].function.arguments must hold a JSON object, not list",
    ),
    "no_arguments": (
        {"calls": [{"function": {"name": "add"}}]},
        "tool_calls[0].function.arguments must be an object or a string of JSON holding one",
    ),
    "not_a_function": (
        {"calls": [{"type": "retrieval", "function": {"name": "add", "arguments": {}}}]},
        "messages[1].tool_calls[0].type 'retrieval' is not 'function'",
    ),
    "result_not_text": ({"result": {"content": {"sky": "rainy"}}}, "messages[2].content must be"),
    "result_id_not_text": ({"result": {"tool_call_id": 1}}, "messages[2].tool_call_id must be"),
    "silent_reply": ({"calls": None}, "messages[1].content must be a string"),
}


def _bad_record(edit: dict) -> dict:
    chat = copy.deepcopy(CHAT)
    if "calls" in edit:
        chat[1]["tool_calls"] = edit["calls"]
    chat[2].update(edit.get("result", {}))
    record = {"messages": chat, "tools": TOOLS}
    if "tools" in edit:
        record["tools"] = edit["tools"]
    return record


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tool_data_is_one_line_naming_the_file_and_line(case):
    edit, reason = BAD[case]
    with pytest.raises(BadRecordError) as info:
        _read(_bad_record(edit))
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"{SOURCE}:7: ") and reason in message, message


@pytest.mark.parametrize("value", ["functions", None])
def test_the_tool_key_is_read_as_nemo_rl_writes_it(value):
    """``data.train.tool_key`` (or ``data.default``'s) names where a record's tools are;
    null reads none."""
    from pathlib import Path

    from sft_runtime.runtime.config import validate_config
    from tests.support.small_run import small_raw

    raw = small_raw(Path("/tmp/run"), Path("/tmp/data"))
    raw["data"]["train"] = {"dataset_name": "openai_format", "data_path": "/tmp/t.jsonl"}
    raw["data"]["default"] = {"tool_key": value}
    shape = validate_config(raw).data.train.shape()
    assert shape.tool_key == value
    record = {"messages": CHAT, "functions": TOOLS, "tools": [{"type": "function"}]}
    assert _read(record, shape=shape).tools == (TOOLS if value else None)


def test_a_bad_tools_list_names_the_records_own_key():
    with pytest.raises(BadRecordError, match=r":7: 'functions' must be a list"):
        _read({"messages": CHAT, "functions": "add"}, shape=RecordShape(tool_key="functions"))


def test_a_prepare_data_line_holds_tool_keys_only_where_they_belong():
    """``prepare-data``'s own shape (``{"messages", "tools"}``, what a data set stores) is
    strict where NeMo RL's drops what it does not read: calls on a user message are bad."""
    user = {**CHAT[0], "tool_calls": CALL["tool_calls"]}
    with pytest.raises(BadRecordError, match=r":7: messages\[0\] has unknown key\(s\)"):
        _read({"messages": [user, *CHAT[1:]]}, shape=None)
    assert _read({"messages": [user, *CHAT[1:]]}).messages[0] == CHAT[0]


# ------------------------------------------------------------------------- supervision
@pytest.mark.parametrize(
    "template", [TOOL_TEMPLATE, TOOL_TEMPLATE_MARKED], ids=["prefix", "marked"]
)
@pytest.mark.parametrize("index", range(len(RECORDS)))
def test_the_supervised_tokens_are_what_the_generation_blocks_mark(folder, template, index):
    """With or without markers in the template the runtime renders with, the ids and the
    mask are transformers' own from the marked template: calls supervised, tool results
    and the tool definitions context."""
    tok = _ours(folder, template)
    chat = _read(RECORDS[index])
    ids, mask = tok.encode_chat(chat.messages, tools=chat.tools, chat_format=RENDERED)
    want_ids, want_mask = _reference(tok, chat)
    assert ids == want_ids and mask == want_mask
    final = tok.encode_chat(
        chat.messages, tools=chat.tools, chat_format=RENDERED, only_unmask_final=True
    )
    end = max(i for i, m in enumerate(want_mask) if m) + 1
    start = end
    while want_mask[start - 1]:
        start -= 1
    assert final == (ids, [start <= i < end for i in range(len(ids))])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_calls_train_and_results_and_definitions_are_context(folder, kind):
    tok = _ours(folder)
    chat = _read(RECORDS[KINDS[kind]])
    ids, mask = tok.encode_chat(chat.messages, tools=chat.tools, chat_format=RENDERED)
    supervised = _runs(tok, ids, mask)
    context = "".join(_runs(tok, ids, mask, keep=False))
    replies = [m for m in chat.messages if m["role"] == "assistant"]
    assert len(supervised) == len(replies)
    for run, reply in zip(supervised, replies, strict=True):
        assert run.endswith("<|im_end|>") and (reply.get("content") or "") in run
        for call in reply.get("tool_calls", []):
            name = call["function"]["name"]
            assert f'<tool_call>\n{{"name": "{name}", "arguments": ' in run
    for message in chat.messages:
        if message["role"] == "tool":
            assert f"<tool_response>\n{message['content']}\n</tool_response>" in context
    if chat.tools:
        assert "# Tools" in context and '"name": "get_weather", "description"' in context
    assert not any("<tool_response>" in run or "# Tools" in run for run in supervised)


def test_without_the_generation_prompt_each_reply_carries_its_header(folder):
    """NeMo RL's default (add_generation_prompt: false): a reply after a tool's result, like
    one after a user message, is trained on from its ``<|im_start|>assistant`` header on."""
    headed = ChatFormat(add_bos=True, add_eos=True, add_generation_prompt=False)
    for index in KINDS.values():
        chat = _read(RECORDS[index])
        runs = {}
        for template in (TOOL_TEMPLATE, TOOL_TEMPLATE_MARKED):
            tok = _ours(folder, template)
            ids, mask = tok.encode_chat(chat.messages, tools=chat.tools, chat_format=headed)
            runs[template] = _runs(tok, ids, mask)
            assert ids == _reference(tok, chat)[0]  # ChatML has no BOS to add, ends in EOS
        plain = _runs(tok, *_reference(tok, chat))
        assert runs[TOOL_TEMPLATE] == runs[TOOL_TEMPLATE_MARKED]
        assert runs[TOOL_TEMPLATE] == ["<|im_start|>assistant\n" + run for run in plain]


@pytest.mark.parametrize("kwargs", [(), (("enable_thinking", False),)], ids=["default", "quiet"])
def test_qwen3s_stock_template_renders_the_tools_and_trains_the_calls(tmp_path, kwargs):
    """Qwen3's own template (no markers; it groups tool results in one turn and re-renders
    the last reply) gives apply_chat_template's ids, each reply supervised with its calls.
    Its template reads every assistant's content, so a call alone says ``content: ""``."""
    folder = tmp_path / "qwen3"
    own = train_tokenizer(folder, demo_texts(50) + tool_texts(), template="qwen3")
    tok = _ours(str(folder), None, kwargs)
    for index in KINDS.values():
        record = copy.deepcopy(RECORDS[index])
        for message in record["messages"]:
            message["content"] = message.get("content") or ""
        chat = _read(record)
        ids, mask = tok.encode_chat(chat.messages, tools=chat.tools, chat_format=RENDERED)
        expected = own.apply_chat_template(
            chat.messages, tools=chat.tools, tokenize=True, **dict(kwargs)
        )
        assert ids == list(expected["input_ids"])
        runs = _runs(tok, ids, mask)
        replies = [m for m in chat.messages if m["role"] == "assistant"]
        assert len(runs) == len(replies)
        for run, reply in zip(runs, replies, strict=True):
            assert run.endswith(reply["content"] + "<|im_end|>") or reply.get("tool_calls")
            assert run.count("<tool_call>") == len(reply.get("tool_calls", []))
        assert not any("<tool_response>" in run or "<tools>" in run for run in runs)


def test_tools_reach_every_render_of_a_plain_conversation(folder):
    """A conversation of plain messages is rendered directly (without apply_chat_template's
    conversions) only when it has no tools; with tools it gets the template's tool block."""
    tok = _ours(folder)
    plain = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    assert tok._chat.renders_directly
    with_tools, _ = tok.encode_chat(plain, tools=TOOLS, chat_format=RENDERED)
    without, _ = tok.encode_chat(plain, chat_format=RENDERED)
    hf, template = tok.hf_tokenizer, TOOL_TEMPLATE
    own = hf.apply_chat_template(plain, tools=TOOLS, chat_template=template, tokenize=True)
    assert with_tools == own["input_ids"]
    assert without == hf.apply_chat_template(plain, chat_template=template)["input_ids"]
    assert "# Tools" in hf.decode(with_tools) and "# Tools" not in hf.decode(without)


# ------------------------------------------------------------------------- byte tokenizer
@pytest.mark.parametrize(
    ("messages", "tools"),
    [(CHAT, TOOLS), (CHAT, None), ([CHAT[0], CHAT[3]], TOOLS), (CHAT[2:], None)],
    ids=["all", "calls", "definitions", "result"],
)
def test_the_byte_tokenizer_refuses_tool_calling(messages, tools):
    """Its layout has no place for tools: refused, never trained on without them; in a
    batch the refusal travels as a refused sample (the bad-sample policy decides)."""
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="the byte tokenizer's layout has no place for tools"):
        tok.encode_chat(messages, tools=tools)
    sample = ChatSample(__key__="line000000004", __restore_key__=(), messages=messages, tools=tools)
    encoded = SFTTaskEncoder(tok, max_input_seq_length=512).encode_sample(sample)
    assert encoded.refused == [["line000000004", f"ValueError: {BYTE_REFUSAL}"]]
    assert encoded.loss_masks == [[0.0]]
    plain = [CHAT[0], CHAT[3]]
    assert tok.encode_chat(plain) == tok.encode_chat(plain, tools=None)

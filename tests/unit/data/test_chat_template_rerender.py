"""Templates that re-render earlier turns: Qwen3's stock template trains as it renders whole.

Qwen3 drops an assistant turn's think block once a later user message exists, and with
``enable_thinking=False`` its generation prompt ends in an empty think block. The ids must
still be ``apply_chat_template``'s own, and the supervised tokens each assistant turn as the
whole render shows it: earlier turns without their think block, the last one with it, each
with its ``<|im_end|>``. Template variables (``chat_template_kwargs``) reach every render and
the tokenizer's identity. A template no rule can locate turns in is still refused.
"""

from __future__ import annotations

import functools
import pickle

import pytest

from sft_runtime.runtime.data import chat_template as hf_chat
from sft_runtime.runtime.data.tokenizer import HFChatTokenizer, TokenizerSpec, build_tokenizer
from sft_runtime.runtime.errors import UserInputError
from tests.support.hf_models import (
    CHATML_TEMPLATE,
    LLAMA3_TEMPLATE,
    demo_texts,
    train_tokenizer,
)
from tests.support.qwen3_template import QWEN3_TEMPLATE

pytest.importorskip("transformers")

CHAT = [
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "<think>\nAdd the tens.\n</think>\n\n12 + 30 = 42"},
    {"role": "user", "content": "Echo: alpha beta gamma"},
    {"role": "assistant", "content": "<think>\nRepeat the words.\n</think>\n\nalpha beta gamma"},
    {"role": "user", "content": "Reverse the words: mu nu xi"},
    {"role": "assistant", "content": "<think>\nBack to front.\n</think>\n\nxi nu mu"},
]
# What the whole render shows of each assistant turn, written out by hand.
REPLIES = [
    "12 + 30 = 42<|im_end|>",
    "alpha beta gamma<|im_end|>",
    "<think>\nBack to front.\n</think>\n\nxi nu mu<|im_end|>",
]
NO_THINKING = {"enable_thinking": False}
KWARGS = [{}, NO_THINKING]
KWARG_IDS = ["default", "no-thinking"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    """A tokenizer folder with Qwen's special tokens and Qwen3's stock template."""
    folder = tmp_path_factory.mktemp("qwen3") / "tok"
    train_tokenizer(folder, demo_texts(), template="qwen3")
    return str(folder)


@functools.cache
def _own(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _ours(folder: str, kwargs: dict | None = None, template: str | None = None) -> HFChatTokenizer:
    spec = TokenizerSpec(
        name=folder, chat_template=template or "default", chat_template_kwargs=kwargs
    )
    tok = build_tokenizer(spec)
    assert isinstance(tok, HFChatTokenizer)
    return tok


def _runs(tok, ids: list[int], mask: list[bool]) -> list[str]:
    """The supervised tokens decoded, one string per maximal run."""
    runs: list[list[int]] = []
    previous = False
    for token, keep in zip(ids, mask, strict=True):
        if keep and not previous:
            runs.append([])
        if keep:
            runs[-1].append(token)
        previous = keep
    return [tok.decode(run) for run in runs]


def test_the_template_is_qwen3s_and_it_does_re_render_earlier_turns(qwen3):
    own = _own(qwen3)
    assert own.chat_template == QWEN3_TEMPLATE
    whole = own.apply_chat_template(CHAT, tokenize=False)
    through_first = own.apply_chat_template(CHAT[:2], tokenize=False)
    assert not whole.startswith(through_first)  # the first reply kept its think block there
    for kwargs in KWARGS:
        assert whole == own.apply_chat_template(CHAT, tokenize=False, **kwargs)
    prompt = own.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    quiet = own.apply_chat_template(
        CHAT[:1], tokenize=False, add_generation_prompt=True, **NO_THINKING
    )
    assert whole.startswith(prompt) and not whole.startswith(quiet)
    assert not own.added_tokens_decoder[own.convert_tokens_to_ids("<think>")].special


@pytest.mark.parametrize("kwargs", KWARGS, ids=KWARG_IDS)
def test_ids_are_apply_chat_templates_own(qwen3, kwargs):
    tok = _ours(qwen3, kwargs)
    ids, mask = tok.encode_chat(CHAT)
    assert ids == _own(qwen3).apply_chat_template(CHAT, tokenize=True, **kwargs)["input_ids"]
    assert len(mask) == len(ids)


@pytest.mark.parametrize("kwargs", KWARGS, ids=KWARG_IDS)
def test_each_reply_is_supervised_as_the_whole_render_shows_it(qwen3, kwargs):
    tok = _ours(qwen3, kwargs)
    ids, mask = tok.encode_chat(CHAT)
    assert _runs(tok, ids, mask) == REPLIES
    whole = _own(qwen3).apply_chat_template(CHAT, tokenize=False, **kwargs)
    assert all(reply in whole for reply in REPLIES)
    assert "Add the tens." not in whole and "Repeat the words." not in whole


@pytest.mark.parametrize("kwargs", KWARGS, ids=KWARG_IDS)
def test_user_turns_and_headers_are_context(qwen3, kwargs):
    tok = _ours(qwen3, kwargs)
    ids, mask = tok.encode_chat(CHAT)
    start = _own(qwen3).convert_tokens_to_ids("<|im_start|>")
    assert not any(keep for token, keep in zip(ids, mask, strict=True) if token == start)
    context = tok.decode([t for t, keep in zip(ids, mask, strict=True) if not keep])
    assert context.count("<|im_start|>assistant\n") == 3
    for message in CHAT[::2]:
        assert f"<|im_start|>user\n{message['content']}<|im_end|>" in context
    assert "42" not in context and "Back to front" not in context


@pytest.mark.parametrize("kwargs", KWARGS, ids=KWARG_IDS)
def test_only_unmask_final_supervises_the_last_reply_with_its_think_block(qwen3, kwargs):
    tok = _ours(qwen3, kwargs)
    ids, mask = tok.encode_chat(CHAT, only_unmask_final=True)
    assert ids == tok.encode_chat(CHAT)[0]
    assert _runs(tok, ids, mask) == REPLIES[-1:]
    # cut after the second reply, that one is the last and keeps its block
    ids, mask = tok.encode_chat(CHAT[:4], only_unmask_final=True)
    assert _runs(tok, ids, mask) == [
        "<think>\nRepeat the words.\n</think>\n\nalpha beta gamma<|im_end|>"
    ]


def test_replies_without_reasoning_follow_enable_thinking(qwen3):
    """A plain final reply renders after an empty think block: the model's own output by
    default, the prompt's with ``enable_thinking=False``."""
    plain = [{**m, "content": m["content"].split("</think>\n\n")[-1]} for m in CHAT]
    replies = ["12 + 30 = 42<|im_end|>", "alpha beta gamma<|im_end|>"]
    default, quiet = _ours(qwen3), _ours(qwen3, NO_THINKING)
    last = "<think>\n\n</think>\n\nxi nu mu<|im_end|>"
    assert _runs(default, *default.encode_chat(plain)) == [*replies, last]
    assert _runs(quiet, *quiet.encode_chat(plain)) == [*replies, "xi nu mu<|im_end|>"]


TOOL_CHAT = [
    CHAT[0],
    {
        "role": "assistant",
        "content": "<think>\nUse the tool.\n</think>\n\n",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12}}}],
    },
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "<think>\nThe tool said 42.\n</think>\n\n12 + 30 = 42"},
]


@pytest.mark.parametrize("kwargs", KWARGS, ids=KWARG_IDS)
def test_a_tool_exchange_after_the_last_user_message_keeps_its_think_blocks(qwen3, kwargs):
    """Both replies follow the last user message, so both keep their think blocks; a probe
    ending in a user message would have the template drop the first one."""
    tok = _ours(qwen3, kwargs)
    ids, mask = tok.encode_chat(TOOL_CHAT)
    own = _own(qwen3).apply_chat_template(TOOL_CHAT, tokenize=True, **kwargs)
    assert ids == own["input_ids"]
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 12}}\n</tool_call>'
    assert _runs(tok, ids, mask) == [
        f"<think>\nUse the tool.\n</think>\n\n{call}<|im_end|>",
        "<think>\nThe tool said 42.\n</think>\n\n12 + 30 = 42<|im_end|>",
    ]


TWO_REPLIES = "messages|length > 1 and messages[-1].role == messages[-2].role == 'assistant'"
PROBE_REFUSED = (
    "{%- if " + TWO_REPLIES + " %}{{- raise_exception('roles must alternate') }}{%- endif %}"
)
PROBE_RENDERED_OTHERWISE = "{%- if " + TWO_REPLIES + " %}{{- '(two replies)' }}{%- endif %}"


@pytest.mark.parametrize(
    "preamble", [PROBE_REFUSED, PROBE_RENDERED_OTHERWISE], ids=["refused", "otherwise"]
)
def test_without_a_probe_the_header_is_what_prompt_and_render_share(qwen3, preamble):
    """A template that refuses two replies in a row, or renders what came before them
    otherwise, gives no probe: the replies are still found, from the prompt alone."""
    plain = [{**m, "content": m["content"].split("</think>\n\n")[-1]} for m in CHAT]
    tok = _ours(qwen3, NO_THINKING, preamble + QWEN3_TEMPLATE)
    ids, mask = tok.encode_chat(plain)
    assert _runs(tok, ids, mask) == [
        "12 + 30 = 42<|im_end|>",
        "alpha beta gamma<|im_end|>",
        "xi nu mu<|im_end|>",
    ]


def test_the_generation_prompt_gets_the_template_variables(qwen3):
    own = _own(qwen3)
    for kwargs in KWARGS:
        expected = own.apply_chat_template(
            CHAT[:5], tokenize=True, add_generation_prompt=True, **kwargs
        )["input_ids"]
        assert _ours(qwen3, kwargs).encode_prompt(CHAT[:5]) == expected
    assert _ours(qwen3).encode_prompt(CHAT[:5]) != _ours(qwen3, NO_THINKING).encode_prompt(CHAT[:5])


def test_the_direct_render_passes_the_variables_and_survives_pickling(qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3)
    chat = hf_chat.ChatTemplate(tok, QWEN3_TEMPLATE, NO_THINKING)
    assert chat.renders_directly
    for messages in (CHAT, CHAT[:1], CHAT[:3]):
        for prompt in (False, True):
            expected = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt, **NO_THINKING
            )
            assert chat.render(messages, add_generation_prompt=prompt) == expected
    copy = pickle.loads(pickle.dumps(chat))
    assert copy.renders_directly and copy.template_kwargs == NO_THINKING
    assert copy.tokenize(CHAT) == chat.tokenize(CHAT)
    assert copy.render(CHAT[:1], add_generation_prompt=True).endswith("</think>\n\n")
    # a variable transformers would rebuild first (a tuple) leaves rendering to it
    odd = hf_chat.ChatTemplate(tok, QWEN3_TEMPLATE, {**NO_THINKING, "extra": (1, 2)})
    assert not odd.renders_directly
    assert odd.tokenize(CHAT) == chat.tokenize(CHAT)


def test_generation_markers_get_the_template_variables(tmp_path):
    """A marked template reads the variables too (here a system prompt)."""
    folder = tmp_path / "chatml"
    train_tokenizer(folder, demo_texts(50), template="chatml")
    template = CHATML_TEMPLATE.replace("You are a helpful assistant.", "' + persona + '")
    kwargs = {"persona": "Speak like a pirate."}
    tok = _ours(str(folder), kwargs, template)
    ids, mask = tok.encode_chat(CHAT[:2])
    own = _own(str(folder)).apply_chat_template(
        CHAT[:2],
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **kwargs,
    )
    assert ids == own["input_ids"] and mask == [bool(m) for m in own["assistant_masks"]]
    assert "Speak like a pirate." in tok.decode(ids)


def test_identity_follows_the_template_variables(qwen3):
    base = _ours(qwen3).identity()
    assert _ours(qwen3, {}).identity() == base  # no variables: the identity runs had before
    quiet = _ours(qwen3, NO_THINKING).identity()
    assert quiet != base and quiet.startswith(base + ":template_kwargs=")
    both = {"enable_thinking": False, "x": 1}
    assert _ours(qwen3, both).identity() == _ours(qwen3, dict(reversed(both.items()))).identity()
    assert _ours(qwen3, both).identity() != quiet
    assert _ours(qwen3, NO_THINKING).chat_template_kwargs == NO_THINKING


def test_the_spec_refuses_variables_that_cannot_be_template_variables(qwen3):
    with pytest.raises(ValueError, match="chat_template_kwargs is only valid"):
        TokenizerSpec(chat_template_kwargs=NO_THINKING)
    with pytest.raises(ValueError, match="tokenize, tools are arguments of apply_chat"):
        TokenizerSpec(name=qwen3, chat_template_kwargs={"tokenize": 1, "tools": []})
    with pytest.raises(ValueError, match="plain JSON"):
        TokenizerSpec(name=qwen3, chat_template_kwargs={"when": {1, 2}})
    spec = TokenizerSpec.model_validate(
        {"name": qwen3, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert spec.model_dump(mode="json")["chat_template_kwargs"] == NO_THINKING


def test_an_abbreviating_template_is_trained_as_it_renders_whole(tmp_path):
    """Earlier replies shown as '...' once later messages follow: what the whole render
    shows is what is supervised, the final reply in full."""
    folder = tmp_path / "llama"
    train_tokenizer(folder, demo_texts(50), template="llama3")
    abbreviating = LLAMA3_TEMPLATE.replace(
        "message['content'] | trim",
        "(message['content'] if loop.last or message['role'] != 'assistant' else '...')",
    )
    plain = [{**m, "content": m["content"].split("</think>\n\n")[-1]} for m in CHAT]
    tok = _ours(str(folder), template=abbreviating)
    ids, mask = tok.encode_chat(plain)
    own = _own(str(folder)).apply_chat_template(plain, chat_template=abbreviating, tokenize=True)
    assert ids == own["input_ids"]
    assert _runs(tok, ids, mask) == ["...<|eot_id|>", "...<|eot_id|>", "xi nu mu<|eot_id|>"]


# Replies tagged with how many messages follow them: the render through the message after
# a reply tags it otherwise than the whole render does, so no rule finds its end.
COUNTING = QWEN3_TEMPLATE.replace(
    "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
    "{{- ' (' ~ (messages|length - loop.index) ~ ' more)<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}',
)
# Every message numbered from the end: even the messages before a turn render otherwise.
NUMBERING = LLAMA3_TEMPLATE.replace(
    "message['content'] | trim", "message['content'] ~ ' #' ~ (messages|length - loop.index0)"
)


@pytest.mark.parametrize(
    ("layout", "template"),
    [("qwen3", COUNTING), ("llama3", NUMBERING)],
    ids=["counting", "numbering"],
)
def test_a_template_no_rule_can_locate_turns_in_is_refused(tmp_path, layout, template):
    from transformers import AutoTokenizer

    assert template not in (QWEN3_TEMPLATE, LLAMA3_TEMPLATE)  # the edit took
    folder = str(tmp_path / layout)
    train_tokenizer(folder, demo_texts(50), template=layout)
    with pytest.raises(UserInputError, match="generation") as info:
        _ours(folder, template=template)
    assert "differently once later messages follow" in str(info.value)
    assert "policy.tokenizer.chat_template" in str(info.value)
    chat = hf_chat.ChatTemplate(AutoTokenizer.from_pretrained(folder), template)
    with pytest.raises(ValueError, match="assistant message 1 in"):
        chat.tokenize(CHAT)
    if template is NUMBERING:  # one exchange: the reply ends the render, only its start fails
        with pytest.raises(ValueError, match="assistant message 1 in"):
            chat.tokenize(CHAT[:2])

"""Hugging Face chat templates: the ids are the tokenizer's own, the loss is on the assistant.

Both template kinds are exercised with real (tiny, offline) tokenizers: ChatML with
``{% generation %}`` markers (tiny_qwen2) and a Llama-3 layout without markers that emits
its own BOS (tiny_llama), whose assistant turns are found by prefix renders.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from megatron.energon import SkipSample

from sft_runtime.runtime.data import chat_template as hf_chat
from sft_runtime.runtime.data.sample import ChatSample
from sft_runtime.runtime.data.task_encoder import (
    EncodedChat,
    SFTTaskEncoder,
    collate_rows,
    encode_conversation,
)
from sft_runtime.runtime.data.tokenizer import (
    HFChatTokenizer,
    TokenizerSpec,
    apply_chat_template,
    build_tokenizer,
    save_tokenizer,
)
from sft_runtime.runtime.errors import UserInputError
from tests.support.hf_models import CHATML_TEMPLATE, LLAMA3_TEMPLATE, train_tokenizer

pytest.importorskip("transformers")

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42"},
    {"role": "user", "content": "Echo: alpha beta gamma"},
    {"role": "assistant", "content": "alpha beta gamma"},
    {"role": "user", "content": "Reverse the words: mu nu xi"},
    {"role": "assistant", "content": "xi nu mu"},
]
NO_SYSTEM = CHAT[1:3]
END = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>"}
HEADERS = {
    "llama": ("<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>"),
    "qwen2": ("<|im_start|>",),
}


@functools.cache
def _own(folder: str):
    """The tokenizer as a user of the model folder would load it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@functools.cache
def _ours(folder: str, chat_template: str | None = None) -> HFChatTokenizer:
    spec = TokenizerSpec(name=folder, chat_template=chat_template or "default")
    tok = build_tokenizer(spec)
    assert isinstance(tok, HFChatTokenizer)
    return tok


@pytest.fixture(params=["llama", "qwen2"])
def family(request) -> str:
    return request.param


@pytest.fixture
def folder(family, tiny_llama, tiny_qwen2) -> str:
    return str(tiny_llama if family == "llama" else tiny_qwen2)


def _runs(ids: list[int], mask: list) -> list[list[int]]:
    """The supervised tokens, grouped into maximal runs (one per supervised turn)."""
    runs: list[list[int]] = []
    previous = False
    for token, keep in zip(ids, mask, strict=True):
        if keep and not previous:
            runs.append([])
        if keep:
            runs[-1].append(token)
        previous = bool(keep)
    return runs


def _replies(folder: str, messages, **kw) -> list[str]:
    tok = _ours(folder, kw.pop("chat_template", None))
    ids, mask = tok.encode_chat(messages, **kw)
    return [tok.decode(run) for run in _runs(ids, mask)]


@pytest.mark.parametrize("messages", [CHAT, NO_SYSTEM, CHAT[:4]], ids=["3turns", "1turn", "open"])
def test_ids_are_the_tokenizers_own_apply_chat_template(folder, messages):
    ids, mask = _ours(folder).encode_chat(messages)
    assert ids == _own(folder).apply_chat_template(messages, tokenize=True)["input_ids"]
    assert len(mask) == len(ids)
    assert apply_chat_template(_ours(folder), messages) == (ids, mask)


def test_bos_once_when_the_template_emits_it_and_never_for_chatml(tiny_llama, tiny_qwen2):
    llama, own = _ours(str(tiny_llama)), _own(str(tiny_llama))
    ids, _ = llama.encode_chat(CHAT)
    assert ids[0] == llama.bos_id and ids.count(llama.bos_id) == 1
    # The trap is real in this tokenizer: tokenizing the render with special tokens doubles it.
    doubled = own(hf_chat.render(own, CHAT, LLAMA3_TEMPLATE))["input_ids"]
    assert doubled[:2] == [llama.bos_id, llama.bos_id]
    qwen = _ours(str(tiny_qwen2))
    ids, _ = qwen.encode_chat(CHAT)
    assert qwen.bos_id is None and _own(str(tiny_qwen2)).bos_token is None
    assert ids[0] == _own(str(tiny_qwen2)).convert_tokens_to_ids("<|im_start|>")


def test_supervised_tokens_are_each_reply_and_its_end_of_turn_token(folder, family):
    expected = [m["content"] + END[family] for m in CHAT if m["role"] == "assistant"]
    assert _replies(folder, CHAT) == expected
    assert _replies(folder, NO_SYSTEM) == ["12 + 30 = 42" + END[family]]


def test_headers_injected_text_and_other_roles_are_never_supervised(folder, family):
    tok, own = _ours(folder), _own(folder)
    ids, mask = tok.encode_chat(NO_SYSTEM)  # the template injects a default system prompt
    header_ids = {own.convert_tokens_to_ids(t) for t in HEADERS[family]}
    assert not any(m for t, m in zip(ids, mask, strict=True) if t in header_ids)
    context = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    injected = "helpful assistant" if family == "qwen2" else "Cutting Knowledge Date"
    assert injected in context and "What is 12 + 30?" in context and "assistant" in context
    assert "= 42" not in context
    first = mask.index(True)
    assert tok.decode(ids[:first]).endswith("\n")  # the header ends before the reply starts


def test_only_unmask_final_supervises_the_last_reply_alone(folder, family):
    assert _replies(folder, CHAT, only_unmask_final=True) == ["xi nu mu" + END[family]]
    ids_all, _ = _ours(folder).encode_chat(CHAT)
    ids_final, _ = _ours(folder).encode_chat(CHAT, only_unmask_final=True)
    assert ids_final == ids_all


def test_a_chat_without_assistant_supervises_nothing(folder):
    ids, mask = _ours(folder).encode_chat(CHAT[:2])
    assert ids and not any(mask)
    assert not any(_ours(folder).encode_chat(CHAT[:2], only_unmask_final=True)[1])


def test_spans_come_from_the_render_not_the_raw_content(tiny_llama):
    """Llama 3 trims contents: the supervised text is what the template rendered."""
    messages = [CHAT[1], {"role": "assistant", "content": "  42 \n"}]
    assert _replies(str(tiny_llama), messages) == ["42<|eot_id|>"]


def test_prefix_renders_and_generation_markers_agree_on_chatml(tiny_qwen2):
    """ChatML without markers goes the prefix-render way; the newline the template puts after
    ``<|im_end|>`` is layout and stays unsupervised, exactly as the markers say."""
    unmarked = CHATML_TEMPLATE.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", ""
    )
    assert not hf_chat.has_generation_markers(unmarked)
    assert hf_chat.has_generation_markers(CHATML_TEMPLATE)
    folder = str(tiny_qwen2)
    for only_final in (False, True):
        marked = _ours(folder).encode_chat(CHAT, only_unmask_final=only_final)
        by_prefix = _ours(folder, unmarked).encode_chat(CHAT, only_unmask_final=only_final)
        assert by_prefix == marked


def test_a_tokenizer_without_template_is_refused_then_accepted_from_the_spec(tmp_path):
    folder = tmp_path / "bare"
    train_tokenizer(folder, ["user: hi", "assistant: hello"] * 20, template="none")
    with pytest.raises(UserInputError, match="policy.tokenizer.chat_template") as info:
        build_tokenizer(TokenizerSpec(name=str(folder)))
    assert str(folder) in str(info.value)
    tok = _ours(str(folder), CHATML_TEMPLATE)
    ids, mask = tok.encode_chat(CHAT)
    own = _own(str(folder)).apply_chat_template(CHAT, chat_template=CHATML_TEMPLATE)
    assert ids == own["input_ids"]
    assert [tok.decode(r) for r in _runs(ids, mask)][-1] == "xi nu mu<|im_end|>"


def test_the_spec_template_is_for_hugging_face_tokenizers_only():
    with pytest.raises(ValueError, match="chat_template is only valid"):
        TokenizerSpec(chat_template=CHATML_TEMPLATE)


def test_an_opening_assistant_message_needs_markers(tiny_llama, tiny_qwen2):
    opening = [{"role": "assistant", "content": "Hi."}, *NO_SYSTEM]
    with pytest.raises(ValueError, match="opens with an assistant"):
        _ours(str(tiny_llama)).encode_chat(opening)
    assert len(_replies(str(tiny_qwen2), opening)) == 2


def test_identity_follows_the_template(tiny_llama):
    folder = str(tiny_llama)
    variant = LLAMA3_TEMPLATE.replace("December 2023", "July 2024")
    base, same, other = _ours(folder), _ours(folder, LLAMA3_TEMPLATE), _ours(folder, variant)
    assert base.identity() == same.identity()
    assert other.identity() != base.identity()
    assert other.identity().rsplit(":", 1)[0] == base.identity().rsplit(":", 1)[0]
    assert other.encode_chat(NO_SYSTEM)[0] != base.encode_chat(NO_SYSTEM)[0]


def test_tokens_in_spans_keeps_tokens_that_straddle_a_boundary():
    offsets = [(0, 3), (3, 6), (6, 6), (6, 9), (9, 12)]
    assert hf_chat.tokens_in_spans(offsets, [(4, 7)]) == [False, True, True, True, False]
    assert hf_chat.tokens_in_spans(offsets, [(9, 12), (0, 1)]) == [True] + [False] * 3 + [True]
    assert hf_chat.tokens_in_spans(offsets, [(5, 5)]) == [False] * 5
    assert hf_chat.tokens_in_spans([], [(0, 3)]) == []
    # a token with no characters is the point it sits at: inside a span or not
    assert hf_chat.tokens_in_spans([(0, 2), (2, 2), (2, 4)], [(2, 3)]) == [False, True, True]
    assert hf_chat.tokens_in_spans([(0, 2), (2, 2), (2, 4)], [(3, 4)]) == [False, False, True]


def test_the_loss_mask_follows_the_batch_contract(folder):
    """A target is a supervised token that is not the first of its segment."""
    tok = _ours(folder)
    ids, supervised = tok.encode_chat(CHAT)
    enc_ids, mask = encode_conversation(tok, CHAT, max_length=10_000)
    assert enc_ids == ids
    assert mask == [0.0] + [1.0 if s else 0.0 for s in supervised[1:]]
    short_ids, short_mask = encode_conversation(tok, CHAT, max_length=40)
    assert short_ids == ids[:40] and short_mask == mask[:40]
    other_ids, other_mask = encode_conversation(tok, NO_SYSTEM, max_length=10_000)
    row = EncodedChat(
        __key__="a",
        __restore_key__=(),
        source_ids=["a0", "a1"],
        token_ids=[ids, other_ids],
        loss_masks=[mask, other_mask],
    )
    batch = collate_rows([row], pad_id=tok.pad_id, pad_multiple=8)
    assert batch.loss_mask[0, : len(ids)].tolist() == mask
    assert batch.loss_mask[0, len(ids) : len(ids) + len(other_ids)].tolist() == other_mask
    assert batch.loss_mask[0, len(ids)] == 0.0 and batch.segment_ids[0, len(ids)] == 1
    assert batch.valid_tokens == sum(mask) + sum(other_mask)


def test_the_encoder_skips_chats_with_nothing_to_learn(folder):
    tok = _ours(folder)
    first_target = encode_conversation(tok, CHAT, max_length=10_000)[1].index(1.0)
    sample = ChatSample(__key__="k", __restore_key__=(), messages=CHAT)
    encoded = SFTTaskEncoder(tok, max_input_seq_length=first_target + 1).encode_sample(sample)
    assert encoded.length == first_target + 1
    with pytest.raises(SkipSample):
        SFTTaskEncoder(tok, max_input_seq_length=first_target).encode_sample(sample)
    no_reply = ChatSample(__key__="q", __restore_key__=(), messages=CHAT[:2])
    with pytest.raises(SkipSample):
        SFTTaskEncoder(tok, max_input_seq_length=10_000).encode_sample(no_reply)


@pytest.mark.parametrize("override", [False, True])
def test_a_saved_tokenizer_renders_the_same_ids(folder, tmp_path, override):
    from transformers import AutoTokenizer

    variant = "{{- '# chat log\\n' -}}" + _own(folder).chat_template if override else None
    spec = TokenizerSpec(name=folder, chat_template=variant or "default")
    out = tmp_path / "policy" / "tokenizer"
    written = save_tokenizer(spec, out)
    assert all(Path(p).parent == out for p in written)
    assert sorted(Path(p).name for p in written) == sorted(p.name for p in out.iterdir())
    reloaded = AutoTokenizer.from_pretrained(str(out))
    ids, _ = _ours(folder, variant).encode_chat(CHAT)
    assert reloaded.apply_chat_template(CHAT, tokenize=True)["input_ids"] == ids
    assert (ids != _ours(folder).encode_chat(CHAT)[0]) == override


def test_the_backend_encoding_is_the_tokenizer_call(folder):
    """The per-sample shortcut past ``tokenizer(...)`` gives that call's ids and offsets."""
    import random

    from sft_runtime.runtime.data.demo import demo_conversation

    tok, rng = _ours(folder).hf_tokenizer, random.Random(3)
    texts = [hf_chat.render(tok, demo_conversation(rng), _ours(folder).chat_template)]
    texts += [hf_chat.render(tok, CHAT, _ours(folder).chat_template), "plain text, no markers"]
    for text in texts:
        call = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = hf_chat._encode_with_offsets(tok, text)
        assert ids == call["input_ids"] and len(ids) > 3
        assert [tuple(o) for o in offsets] == [tuple(o) for o in call["offset_mapping"]]


def test_a_backend_set_to_truncate_is_not_used_as_it_is(tiny_llama):
    """Truncation left on the Rust tokenizer (a tokenizer.json can carry one) would cut a
    conversation short; the ids stay whole, as the tokenizer call gives them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    template = _ours(str(tiny_llama)).chat_template
    chat = hf_chat.ChatTemplate(tok, template)
    whole, _ = chat.tokenize(CHAT)
    tok.backend_tokenizer.enable_truncation(max_length=5)
    ids, mask = chat.tokenize(CHAT)
    assert ids == whole and len(ids) > 5 and any(mask)


def _fresh(folder: str):
    """A tokenizer of the folder no other test shares (these tests change or pickle it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_a_plain_chat_renders_as_apply_chat_template_does(folder):
    """Plain conversations skip transformers' input conversions; the text stays its own."""
    import random

    from sft_runtime.runtime.data.demo import demo_conversation

    tok, template = _fresh(folder), _ours(folder).chat_template
    chat = hf_chat.ChatTemplate(tok, template)
    assert chat.renders_directly
    rng = random.Random(5)
    odd = [
        {"role": "user", "content": "<|eot_id|> and <|im_end|> as text, ünïcode, \n\n"},
        {"role": "assistant", "content": ""},
    ]
    cases = [CHAT, NO_SYSTEM, CHAT[:4], CHAT[:1], odd]
    cases += [demo_conversation(rng) for _ in range(20)]
    for messages in cases:
        for prompt in (False, True):
            expected = hf_chat.render(tok, messages, template, add_generation_prompt=prompt)
            assert chat.render(messages, add_generation_prompt=prompt) == expected


def test_a_message_with_more_than_role_and_content_is_rendered_by_transformers(tiny_llama):
    """transformers copies a reasoning field under the name templates read (and drops keys
    set to None); such a conversation is rendered by ``apply_chat_template`` itself."""
    tok = _fresh(str(tiny_llama))
    template = (
        "{%- for m in messages -%}{{- m['role'] + ': ' -}}"
        "{%- if m.reasoning_content is defined -%}[{{ m.reasoning_content }}] {% endif -%}"
        "{%- if m.name is defined -%}({{ m.name }}) {% endif -%}"
        "{{- m['content'] + '\\n' -}}{%- endfor -%}"
    )
    chat = hf_chat.ChatTemplate(tok, template)
    assert chat.renders_directly
    messages = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "hello", "reasoning": "be kind"},
    ]
    text = chat.render(messages)
    assert text == hf_chat.render(tok, messages, template)
    assert text == "user: hi\nassistant: [be kind] hello\n"


def test_a_direct_render_that_disagrees_is_not_used(tiny_llama):
    """Should transformers ever hand a template more than the direct render does, its own
    rendering wins, for every conversation."""
    tok, template = _fresh(str(tiny_llama)), _ours(str(tiny_llama)).chat_template
    own = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **kw: own(*a, **kw) + "<|eot_id|>"
    chat = hf_chat.ChatTemplate(tok, template)
    assert not chat.renders_directly
    assert chat.render(CHAT).endswith("<|eot_id|><|eot_id|>")


def test_a_chat_template_pickles_and_renders_directly_after(tiny_llama):
    import pickle

    tok, template = _fresh(str(tiny_llama)), _ours(str(tiny_llama)).chat_template
    chat = hf_chat.ChatTemplate(tok, template)
    copy = pickle.loads(pickle.dumps(chat))
    assert copy.renders_directly
    assert copy.tokenize(CHAT) == chat.tokenize(CHAT)

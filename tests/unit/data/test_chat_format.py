"""data.add_bos, data.add_eos and data.add_generation_prompt give NeMo RL's rows.

The expected rows are built the way NeMo RL's ``sft_processor`` builds them, message by
message from ``apply_chat_template`` pieces of a real tokenizer (tests/support/nemo_rl_rows.py);
the runtime renders and tokenizes the whole conversation once, and the rows must agree.
"""

from __future__ import annotations

import itertools

import pytest

from sft_runtime.runtime.data.chat_format import LEGACY_FORMAT, ChatFormat, row_format_fingerprint
from sft_runtime.runtime.data.task_encoder import encode_conversation
from sft_runtime.runtime.data.tokenizer import ByteTokenizer, HFChatTokenizer
from tests.support.hf_models import CHATML_TEMPLATE, demo_texts, train_tokenizer
from tests.support.nemo_rl_rows import BARE_TEMPLATE
from tests.support.nemo_rl_rows import nemo_rl_row as nemo_rows

pytest.importorskip("transformers")

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "Reverse the words: mu nu xi"},
    {"role": "assistant", "content": "xi nu mu"},
]
FORMATS = [
    ChatFormat(add_bos=bos, add_eos=eos, add_generation_prompt=prompt)
    for bos, eos, prompt in itertools.product([False, True], repeat=3)
]
LIMIT = 4096


def _name(fmt: ChatFormat) -> str:
    return "-".join(f"{key}={int(on)}" for key, on in fmt.model_dump().items())


def nemo_rl_row(tok, template: str, messages, fmt: ChatFormat) -> tuple[list[int], list[float]]:
    return nemo_rows(tok, template, messages, **fmt.model_dump())


def _layout_after_closers(tok, ids: list[int], mask: list[float]) -> list[float]:
    """`mask` with the newlines after an end-of-turn token as context: NeMo RL's chunks carry
    the layout a template writes after ``<|im_end|>``, this runtime never trains on it
    (chat_template.py); that is the one place the rows may differ."""
    out = list(mask)
    for k in range(1, len(ids)):
        if ids[k - 1] == tok.eos_token_id and tok.decode([ids[k]]).strip() == "":
            out[k] = 0.0
    return out


@pytest.fixture(scope="module")
def bare(tiny_llama) -> HFChatTokenizer:
    return HFChatTokenizer(str(tiny_llama), chat_template=BARE_TEMPLATE)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: _name(f))
@pytest.mark.parametrize("messages", [CHAT, CHAT[1:3]], ids=["two-replies", "one-reply"])
def test_rows_are_nemo_rls_where_the_template_adds_no_bos_or_eos(bare, fmt, messages):
    ours = encode_conversation(bare, messages, max_length=LIMIT, chat_format=fmt)
    assert ours == nemo_rl_row(bare.hf_tokenizer, bare.chat_template, messages, fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: _name(f))
def test_rows_are_nemo_rls_with_a_template_that_emits_bos_and_eos(tiny_llama, fmt):
    tok = HFChatTokenizer(str(tiny_llama))  # Llama 3 style: BOS in the template, <|eot_id|>
    ours = encode_conversation(tok, CHAT, max_length=LIMIT, chat_format=fmt)
    assert ours == nemo_rl_row(tok.hf_tokenizer, tok.chat_template, CHAT, fmt)


@pytest.mark.parametrize("marked", [True, False], ids=["generation-markers", "prefix-renders"])
@pytest.mark.parametrize("prompt", [True, False], ids=["prompt-header", "reply-header"])
def test_chatml_rows_are_nemo_rls_but_for_the_layout_after_im_end(tiny_qwen2, marked, prompt):
    template = CHATML_TEMPLATE
    if not marked:
        template = template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    tok = HFChatTokenizer(str(tiny_qwen2), chat_template=template)
    fmt = ChatFormat(add_bos=True, add_eos=True, add_generation_prompt=prompt)
    ids, mask = encode_conversation(tok, CHAT, max_length=LIMIT, chat_format=fmt)
    want_ids, want_mask = nemo_rl_row(tok.hf_tokenizer, template, CHAT, fmt)
    assert ids == want_ids
    assert mask == _layout_after_closers(tok.hf_tokenizer, want_ids, want_mask)


def _targets(tok, row) -> str:
    ids, mask = row
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_add_bos_puts_the_bos_first_as_context(bare):
    off = encode_conversation(bare, CHAT, max_length=LIMIT, chat_format=LEGACY_FORMAT)
    on = encode_conversation(
        bare, CHAT, max_length=LIMIT, chat_format=LEGACY_FORMAT.model_copy(update={"add_bos": True})
    )
    assert on[0] == [bare.bos_id, *off[0]]
    assert on[1] == [0.0, *off[1]]  # BOS and the first token after it: context


def test_add_eos_appends_the_eos_to_the_last_reply_as_a_target(bare):
    off = encode_conversation(bare, CHAT, max_length=LIMIT, chat_format=LEGACY_FORMAT)
    on = encode_conversation(
        bare, CHAT, max_length=LIMIT, chat_format=LEGACY_FORMAT.model_copy(update={"add_eos": True})
    )
    assert on[0] == [*off[0], bare.eos_id]
    assert on[1] == [*off[1], 1.0]
    # a conversation that ends with a user message: the EOS is that message's, context
    ends_with_user = CHAT[:4]
    eos_only = LEGACY_FORMAT.model_copy(update={"add_eos": True})
    ids, mask = encode_conversation(bare, ends_with_user, max_length=LIMIT, chat_format=eos_only)
    assert ids[-1] == bare.eos_id and mask[-1] == 0.0


def test_without_the_generation_prompt_the_header_is_trained_on(bare):
    with_prompt = encode_conversation(bare, CHAT, max_length=LIMIT, chat_format=LEGACY_FORMAT)
    headed = encode_conversation(
        bare,
        CHAT,
        max_length=LIMIT,
        chat_format=LEGACY_FORMAT.model_copy(update={"add_generation_prompt": False}),
    )
    assert headed[0] == with_prompt[0]  # the same tokens, other targets
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert _targets(bare, with_prompt) == "42\nxi nu mu\n"
    assert _targets(bare, headed) == f"{header}42\n{header}xi nu mu\n"


def test_a_template_that_has_bos_and_eos_is_left_as_it_renders(tiny_llama):
    tok = HFChatTokenizer(str(tiny_llama))
    own = tok.hf_tokenizer.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    for fmt in (LEGACY_FORMAT, ChatFormat(add_bos=True, add_eos=True, add_generation_prompt=True)):
        assert encode_conversation(tok, CHAT, max_length=LIMIT, chat_format=fmt)[0] == own
    # so a loader state saved before the keys existed still matches: no format in the print
    assert (
        row_format_fingerprint(
            tok, ChatFormat(add_bos=True, add_eos=True, add_generation_prompt=True)
        )
        == {}
    )
    bare = HFChatTokenizer(str(tiny_llama), chat_template=BARE_TEMPLATE)
    assert row_format_fingerprint(bare, ChatFormat()) == {
        "chat_format": {"add_bos": True, "add_eos": True, "add_generation_prompt": False}
    }


def test_an_assistant_after_a_system_message_carries_its_header_either_way(bare):
    """NeMo RL renders the generation prompt only after a user message."""
    messages = [CHAT[0], {"role": "assistant", "content": "Hi."}, *CHAT[1:3]]
    tok = bare.hf_tokenizer
    for prompt in (True, False):
        fmt = ChatFormat(add_generation_prompt=prompt)
        row = encode_conversation(bare, messages, max_length=LIMIT, chat_format=fmt)
        assert row == nemo_rl_row(tok, bare.chat_template, messages, fmt)


def test_the_byte_tokenizer_has_bos_and_eos_and_its_role_marker_is_the_header():
    tok = ByteTokenizer()
    plain = encode_conversation(tok, CHAT, max_length=LIMIT, chat_format=LEGACY_FORMAT)
    both = ChatFormat(add_bos=True, add_eos=True, add_generation_prompt=True)
    assert encode_conversation(tok, CHAT, max_length=LIMIT, chat_format=both) == plain
    headed = encode_conversation(
        tok, CHAT, max_length=LIMIT, chat_format=ChatFormat(add_generation_prompt=False)
    )
    assert headed[0] == plain[0]
    marker = tok.role_id("assistant")
    changed = [k for k, (a, b) in enumerate(zip(plain[1], headed[1], strict=True)) if a != b]
    assert changed and all(plain[0][k] == marker and headed[1][k] == 1.0 for k in changed)
    assert len(changed) == 2  # both replies' markers


def _runs(tok, ids: list[int], mask: list[float]) -> list[str]:
    """The targets decoded, one string per maximal run."""
    runs: list[list[int]] = []
    for k, token in enumerate(ids):
        if mask[k] and (k == 0 or not mask[k - 1]):
            runs.append([])
        if mask[k]:
            runs[-1].append(token)
    return [tok.decode(run) for run in runs]


def test_a_re_rendering_template_trains_each_header_with_its_reply(tmp_path_factory):
    """Qwen3 drops earlier replies' think blocks: each reply is trained on as the whole render
    shows it, now with the header before it."""
    folder = tmp_path_factory.mktemp("qwen3") / "tok"
    train_tokenizer(folder, demo_texts(), template="qwen3")
    chat = [
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n42"},
        {"role": "user", "content": "Reverse: mu nu xi"},
        {"role": "assistant", "content": "<think>\nFlip.\n</think>\n\nxi nu mu"},
    ]
    header = "<|im_start|>assistant\n"
    replies = ["42<|im_end|>", "<think>\nFlip.\n</think>\n\nxi nu mu<|im_end|>"]
    for kwargs in (None, {"enable_thinking": False}):
        tok = HFChatTokenizer(str(folder), chat_template_kwargs=kwargs)
        for prompt, before in ((True, ""), (False, header)):
            fmt = ChatFormat(add_generation_prompt=prompt)
            row = encode_conversation(tok, chat, max_length=LIMIT, chat_format=fmt)
            assert _runs(tok.hf_tokenizer, *row) == [before + reply for reply in replies]

"""Token ids and assistant-only supervision from a Hugging Face tokenizer's own chat template.

A fine-tuned chat model is only as good as the agreement between training and inference
tokenization, so a conversation is rendered by the tokenizer's template exactly once and that
text is tokenized exactly once, with ``add_special_tokens=False``: the ids are then those of
``tokenizer.apply_chat_template(messages, tokenize=True)``, token for token. Tokenizing
messages one by one would differ wherever BPE merges across a message boundary, and adding
special tokens would double the BOS of templates that emit it themselves (Llama 3).

The supervised tokens are the assistant turns as the template renders them, end-of-turn token
included (the model must learn to stop); what the template injects (role headers, default
system prompts, dates) is context. Turns are located in the rendered text, never by searching
for the raw content, since templates trim, rewrite and re-render it:

- a template with ``{% generation %}`` markers says itself which characters are the
  assistant's; transformers maps them onto the tokens (``return_assistant_tokens_mask``);
- any other template is asked where each assistant turn starts (the render of the messages
  before it with the generation prompt) and ends (the render including it). Both must be
  prefixes of the whole render, or the template rewrites earlier turns and needs markers.

Character spans become tokens through the offsets of the one tokenization: a token belongs
to a turn when its characters overlap the turn's, so merges at a boundary cannot shift it.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

from sft_runtime.runtime.errors import UserInputError

TEMPLATE_KEY = "policy.tokenizer.chat_template"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Used to check a template once, when the tokenizer is built, rather than per sample.
_PROBE = [
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Once more."},
    {"role": "assistant", "content": "Hello again."},
]

Messages = list[dict[str, Any]]
Span = tuple[int, int]


def resolve_template(tokenizer: Any, override: str | None, *, path: str) -> str:
    """The Jinja source that will render conversations: `override` (the config's
    ``policy.tokenizer.chat_template``) when given, else the tokenizer's own default."""
    if override is not None:
        if not override.strip():
            raise UserInputError(f"{TEMPLATE_KEY} is empty")
        return override
    if tokenizer.chat_template is None:
        raise UserInputError(
            f"tokenizer.path {path!r}: the tokenizer has no chat template; set "
            f"{TEMPLATE_KEY} to the Jinja template its model was trained with"
        )
    try:
        return str(tokenizer.get_chat_template())
    except ValueError as exc:  # named templates but none called "default"
        raise UserInputError(f"tokenizer.path {path!r}: {exc}; set {TEMPLATE_KEY}") from exc


def template_digest(template: str) -> str:
    """A short stable digest of a template: part of the tokenizer's identity, because the
    same vocabulary under another template yields other ids for the same conversation."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def has_generation_markers(template: str) -> bool:
    return _GENERATION_TAG.search(template) is not None


def render(
    tokenizer: Any, messages: Messages, template: str, *, add_generation_prompt: bool = False
) -> str:
    """The template's text for `messages` (no tokenization)."""
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def encode_prompt(tokenizer: Any, messages: Messages, template: str) -> list[int]:
    """Ids of `messages` followed by the assistant header, as a generation prompt."""
    text = render(tokenizer, messages, template, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_chat(
    tokenizer: Any, messages: Messages, template: str, *, only_unmask_final: bool = False
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is supervised.

    With `only_unmask_final` only the last assistant turn is. A conversation without an
    assistant turn gets an all-False mask (callers skip it rather than train on nothing).
    """
    if has_generation_markers(template):
        return _by_generation_markers(tokenizer, messages, template, only_unmask_final)
    return _by_prefix_renders(tokenizer, messages, template, only_unmask_final)


def _by_generation_markers(
    tokenizer: Any, messages: Messages, template: str, only_unmask_final: bool
) -> tuple[list[int], list[bool]]:
    encoded = tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids = list(encoded["input_ids"])
    mask = [bool(m) for m in encoded["assistant_masks"]]
    if only_unmask_final:
        # One generation block per assistant turn, separated by the next turn's header:
        # the final turn is the last run of marked tokens.
        end = max((i + 1 for i, m in enumerate(mask) if m), default=0)
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        mask = [start <= i < end for i in range(len(mask))]
    return ids, mask


def _by_prefix_renders(
    tokenizer: Any, messages: Messages, template: str, only_unmask_final: bool
) -> tuple[list[int], list[bool]]:
    text = render(tokenizer, messages, template)
    ids, offsets = _encode_with_offsets(tokenizer, text)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if only_unmask_final:
        turns = turns[-1:]
    closers = _special_strings(tokenizer)
    spans = [_assistant_span(tokenizer, messages, template, text, i, closers) for i in turns]
    return ids, tokens_in_spans(offsets, spans)


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets of `text`, as ``tokenizer(text, add_special_tokens=False)``
    gives them. The Rust tokenizer is asked directly when it is set up as that call would
    set it (no truncation, no padding, special tokens kept whole unless the tokenizer splits
    them): the call's argument checks and conversions cost as much as the encoding itself,
    once per sample read. Otherwise the call runs, and leaves the backend set up so."""
    backend = tokenizer.backend_tokenizer
    if (
        backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)
    ):
        encoding = backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), list(encoded["offset_mapping"])


def _assistant_span(
    tokenizer: Any,
    messages: Messages,
    template: str,
    text: str,
    index: int,
    closers: tuple[str, ...],
) -> Span:
    """Characters of assistant turn `index` in `text`: from the end of its header to the end
    of its end-of-turn token (whitespace the template adds after that token is layout)."""
    if index == 0:
        raise ValueError(
            "the conversation opens with an assistant message: without {% generation %} "
            "markers in the chat template its start cannot be told from the template's "
            "preamble"
        )
    before = render(tokenizer, messages[:index], template, add_generation_prompt=True)
    # the final turn's render is the whole conversation's, already at hand
    last = index + 1 == len(messages)
    through = text if last else render(tokenizer, messages[: index + 1], template)
    for prefix in (before, through):
        if not text.startswith(prefix):
            raise ValueError(
                f"the chat template renders message {index} differently once later messages "
                f"follow, so its assistant turns cannot be located by prefix renders; use a "
                f"template with {{% generation %}} markers ({TEMPLATE_KEY})"
            )
    start, end = len(before), len(through)
    body = text[start:end]
    kept = body.rstrip()
    if kept != body and kept.endswith(closers):
        end = start + len(kept)
    return start, max(start, end)


def _special_strings(tokenizer: Any) -> tuple[str, ...]:
    return tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)


def tokens_in_spans(offsets: list[tuple[int, int]], spans: list[Span]) -> list[bool]:
    """Per token (character offsets), whether it overlaps one of `spans` (half-open, any
    order). A token with no characters counts as the point it sits at. Vectorized: it runs
    for every sample read, and a Python loop over the tokens would cost a third of a chat's
    tokenization, more the longer the chat."""
    if not offsets:
        return []
    out = np.zeros(len(offsets), dtype=bool)
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts = bounds[:, 0]
    ends = np.maximum(bounds[:, 1], starts + 1)
    for start, end in spans:
        if end > start:
            out |= (starts < end) & (ends > start)
    return out.tolist()


def check_template(tokenizer: Any, template: str, *, path: str) -> None:
    """Fail at start-up, naming the config key, when `template` cannot render a plain chat or
    supervises nothing in it, rather than skipping every sample later."""
    try:
        _, mask = tokenize_chat(tokenizer, _PROBE, template)
    except Exception as exc:  # a template error can be any type (jinja2, ValueError, ...)
        raise UserInputError(
            f"tokenizer.path {path!r}: the chat template cannot render a user/assistant "
            f"chat ({type(exc).__name__}: {exc}); check {TEMPLATE_KEY}"
        ) from exc
    if not any(mask):
        raise UserInputError(
            f"tokenizer.path {path!r}: the chat template marks no assistant token in a "
            f"user/assistant chat (empty {{% generation %}} blocks?); check {TEMPLATE_KEY}"
        )

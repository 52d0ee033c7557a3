"""NeMo RL's three switches on how a conversation becomes a training row.

NeMo RL's ``sft_processor`` renders a conversation message by message and gives each message
the text its render adds (``get_formatted_message_log``); a message's tokens are trained on
when it is an assistant message. Three ``data`` keys shape those chunks:

- ``add_bos``: the first message starts with the tokenizer's BOS, prepended when the render
  does not already start with it (a template that emits BOS itself is left alone; a
  tokenizer without BOS gets none). It is the first message's, so context.
- ``add_eos``: the last message ends with the tokenizer's EOS, appended (after any trailing
  newlines) when the render, trailing newlines aside, does not already end with it. It is
  the last message's: trained on when that is a supervised assistant turn.
- ``add_generation_prompt``: the assistant header (``<|im_start|>assistant\\n``) is rendered
  with the user message before it, as the generation prompt, so it is context. Without it
  (NeMo RL's default) the header is the first text of the assistant's own chunk, so it is
  trained on; NeMo RL renders the generation prompt only after a user (or tool) message, so
  an assistant turn after any other message carries its header either way.

This runtime renders and tokenizes the whole conversation once (chat_template.py) and applies
these rules to the character spans of that render, so the ids are NeMo RL's wherever its
per-message tokenization agrees with one tokenization of the whole (at special tokens and
newlines, where chat templates put message boundaries). One difference stays, outside these
keys: the layout a template writes after an end-of-turn token (ChatML's newline after
``<|im_end|>``) is context here, where NeMo RL's chunks train on it.

Defaults are NeMo RL's: ``add_bos`` and ``add_eos`` true, ``add_generation_prompt`` false.
Rows exactly as the template renders them, with the header as context, are ``add_bos:
false`` and ``add_generation_prompt: true``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

PROMPT_ROLES = ("user", "tool")  # the messages NeMo RL renders the generation prompt after


class ChatFormat(BaseModel):
    """``data.add_bos``, ``data.add_eos`` and ``data.add_generation_prompt`` (module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    add_bos: bool = True
    add_eos: bool = True
    add_generation_prompt: bool = False

    def bos_to_add(self, text: str, bos_token: str | None) -> str:
        """The text to put before `text`: the BOS, or nothing."""
        if not self.add_bos or not bos_token or text.startswith(bos_token):
            return ""
        return bos_token

    def eos_to_add(self, text: str, eos_token: str | None) -> str:
        """The text to put after `text`: the EOS, or nothing (trailing newlines, such as
        ChatML's after ``<|im_end|>``, do not hide an EOS that is there)."""
        if not self.add_eos or not eos_token or text.rstrip("\n").endswith(eos_token):
            return ""
        return eos_token

    def header_supervised(self, messages: Sequence[dict[str, Any]], index: int) -> bool:
        """Whether assistant message `index`'s header is trained on (module doc)."""
        if index == 0:  # no message before it: the template's preamble and header stay context
            return False
        follows_prompt = messages[index - 1].get("role") in PROMPT_ROLES
        return not (self.add_generation_prompt and follows_prompt)


RENDERED_FORMAT = ChatFormat(add_bos=False, add_eos=True, add_generation_prompt=True)
"""What an encoder gives when called without a format (tools, benchmarks and tests that read
a template as it renders): the render's own text with its end token, headers as context. A
run's rows always come from its config's three keys."""

LEGACY_FORMAT = ChatFormat(add_bos=False, add_eos=False, add_generation_prompt=True)
"""The rows with none of the three switches: the template's text as it is, headers as
context. A loader fingerprint names the format only where it gives other rows than this
one, so a state saved without the keys restores exactly when the rows are still the same."""

_PROBE = [
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Once more."},
    {"role": "assistant", "content": "Hello again."},
]


def row_format_fingerprint(tokenizer: Any, fmt: ChatFormat) -> dict[str, Any]:
    """``{"chat_format": ...}`` when `fmt` gives `tokenizer` other rows than `LEGACY_FORMAT`
    on a probe conversation, else nothing: a resume under another format is refused where
    it changes the rows, and states saved before the keys existed stay valid where it
    does not (a template that emits BOS and EOS itself)."""
    if fmt == LEGACY_FORMAT:
        return {}
    try:
        same = tokenizer.encode_chat(_PROBE, chat_format=fmt) == tokenizer.encode_chat(
            _PROBE, chat_format=LEGACY_FORMAT
        )
    except Exception:  # noqa: BLE001 - a template that refuses the probe: record the format
        same = False
    return {} if same else {"chat_format": fmt.model_dump()}

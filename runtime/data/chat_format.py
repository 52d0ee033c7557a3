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

The two other things that shape a conversation before it is rendered are here too, each in
a section of its own below: its tool calls (the OpenAI layout NeMo RL reads) and the
``prompt_file`` prompt that takes its first user message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
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


# ---------------------------------------------------------------------- tool calls
# Tool calling in a conversation, as NeMo RL's ``openai_format`` data carries it.
#
# A record may hold the tools the model could call (a list of JSON function schemas under
# ``data.*.tool_key``, default ``tools``), assistant messages that call them (``tool_calls``
# in OpenAI's shape: ``[{"type": "function", "function": {"name": ..., "arguments": ...}}]``,
# the arguments an object or a JSON string holding one) and ``tool`` messages with a call's
# result (``content``, optionally ``tool_call_id`` and ``name``). They reach the chat
# template as NeMo RL's sft_processor passes them, ``apply_chat_template(messages,
# tools=tools)`` with the messages as given, for every render of the conversation.
#
# What is trained on follows from that (chat_template.py): an assistant message is supervised
# as the template renders it, its calls included; a tool's result is another message's
# text, and the tool definitions are what the template writes into the system or prompt
# area, so both are context. The byte tokenizer's layout has no place for tools: its
# conversations are refused (tokenizer.py), a data file's naming the line (bring.py).
#
# An empty or null ``tools`` list, and an empty or null ``tool_calls``, is no tools, as
# before tool calling was read: a file prepared earlier keeps the folder it was prepared
# into. The checks here name what is wrong in one line; records.py puts the line's file
# and number in front.


BYTE_REFUSAL = (
    "tool calling needs a Hugging Face tokenizer's chat template (policy.tokenizer.name: "
    "a tokenizer folder); the byte tokenizer's layout has no place for tools"
)


def tools_reason(tools: Any, key: str = "tools") -> str | None:
    """Why `tools` (the value under `key`) is not a list of tool definitions, or None."""
    if not isinstance(tools, list):
        return f"{key!r} must be a list of tool definitions (JSON function schemas)"
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            return f"{key}[{index}] must be an object (a JSON function schema)"
    return None


def tool_calls_reason(calls: Any, where: str) -> str | None:
    """Why `calls` (an assistant message's ``tool_calls``, at `where`) is not OpenAI's
    list of function calls, or None."""
    if not isinstance(calls, list):
        return f"{where} must be a list of calls"
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        if not isinstance(call, dict):
            return f"{at} must be an object"
        if call.get("type", "function") != "function":
            return f"{at}.type {call.get('type')!r} is not 'function'"
        function = call.get("function")
        if not isinstance(function, dict):
            return f"{at}.function must be an object with the name and arguments"
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            return f"{at}.function.name must be a non-empty string"
        reason = _arguments_reason(function.get("arguments"), f"{at}.function.arguments")
        if reason is not None:
            return reason
    return None


def _arguments_reason(arguments: Any, where: str) -> str | None:
    if isinstance(arguments, dict):
        return None
    if not isinstance(arguments, str):
        return f"{where} must be an object or a string of JSON holding one"
    try:
        parsed = json.loads(arguments)
    except ValueError as exc:
        return f"{where} is not JSON ({exc})"
    if not isinstance(parsed, dict):
        return f"{where} must hold a JSON object, not {type(parsed).__name__}"
    return None


def uses_tools(messages: Sequence[dict[str, Any]], tools: Any = None) -> bool:
    """Whether a conversation calls on tools: definitions, a call or a tool's result."""
    if tools:
        return True
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


# ---------------------------------------------------------------------- prompt files
# NeMo RL's ``prompt_file``: a format string the first user message is put into.
#
# NeMo RL reads the file once (``TaskDataSpec``) and, for every conversation, replaces the
# content of the first user message (system messages before it are skipped) with
# ``prompt.format(content)``. The same happens here before the conversation is rendered, for
# every data source (a prepared data set or a data file). A prompt without a ``{}`` would
# drop the user's message, and one with named fields cannot be filled: both are refused when
# the config is read, naming the key.


def read_prompt_file(path: str, key: str) -> str:
    """The prompt in `path` (`key` names it in errors: ValueError, one line)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{key} {path!r}: {exc.strerror or exc}") from None
    try:
        filled = text.format("\0")
    except (IndexError, KeyError, ValueError) as exc:
        raise ValueError(
            f"{key} {path!r}: not a format string with one {{}} for the user message "
            f"({type(exc).__name__}: {exc}); write literal braces as {{{{ and }}}}"
        ) from None
    if "\0" not in filled:
        raise ValueError(
            f"{key} {path!r}: no {{}} for the user message, which the prompt would replace"
        )
    return text


def with_prompt(messages: list[dict[str, Any]], prompt: str | None) -> list[dict[str, Any]]:
    """`messages` with the first user message's content put into `prompt` (a new list;
    unchanged without a prompt or a user message)."""
    if prompt is None:
        return messages
    for index, message in enumerate(messages):
        if message.get("role") == "user":
            filled = {**message, "content": prompt.format(message["content"])}
            return [*messages[:index], filled, *messages[index + 1 :]]
    return messages


def prompt_digest(prompt: str) -> str:
    """A short digest of a prompt's text, for the loader fingerprint."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]

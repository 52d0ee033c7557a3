"""Validation of one JSONL conversation record.

`prepare-data` checks every input line before anything is written, and the task encoder reads
the same normalized shape back from the shards, so the rules live in one place: a record is
either ``{"messages": [...], "tools": [...]?}`` or ``{"prompt", "response"}``; roles are
system, user, assistant or tool; contents are non-empty strings; at least one assistant
turn. Tool calling (chat_format.py) loosens two of them: an assistant message that calls
tools may say nothing besides (its ``content`` empty or left out), and a tool's result may
be empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from sft_runtime.runtime.data.chat_format import tool_calls_reason, tools_reason, uses_tools
from sft_runtime.runtime.data.record_shapes import RecordShape
from sft_runtime.runtime.errors import UserInputError

ROLES = ("system", "user", "assistant", "tool")
# The keys a message of each role may hold besides its role and content.
_OPTIONAL_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}


@dataclass(frozen=True)
class Conversation:
    """One valid record: its messages and the tool definitions every render of it gets
    (None: no tools)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    @property
    def uses_tools(self) -> bool:
        return uses_tools(self.messages, self.tools)


class BadRecordError(UserInputError):
    """A JSONL line that is not a valid conversation; the message names the file and line."""

    def __init__(self, source: str, line_no: int, reason: str) -> None:
        super().__init__(f"{source}:{line_no}: {reason}")
        self.source = source
        self.line_no = line_no
        self.reason = reason


def _reason_for_message(index: int, message: Any) -> str | None:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        return f"{where} must be an object"
    role = message.get("role")
    if role not in ROLES:
        return f"{where}.role {role!r} is not one of {list(ROLES)}"
    unknown = sorted(set(message) - {"role", "content", *_OPTIONAL_KEYS.get(role, ())})
    if unknown:
        return f"{where} has unknown key(s) {unknown}"
    if message.get("tool_calls") is not None:
        reason = tool_calls_reason(message["tool_calls"], f"{where}.tool_calls")
        if reason is not None:
            return reason
    for key in _OPTIONAL_KEYS["tool"]:
        if message.get(key) is not None and not isinstance(message[key], str):
            return f"{where}.{key} must be a string"
    calls = bool(message.get("tool_calls"))
    content = message.get("content")
    if calls and content is None:
        return None  # a call alone
    if not isinstance(content, str):
        return f"{where}.content must be a string"
    if not content.strip() and not calls and role != "tool":
        return f"{where}.content is empty"
    return None


def _reason_for_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for index, message in enumerate(messages):
        reason = _reason_for_message(index, message)
        if reason is not None:
            return reason
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None


def normalize_record(record: Any) -> tuple[Conversation | None, str | None]:
    """Return (conversation, None) for a valid record or (None, reason) for an invalid one."""
    if not isinstance(record, dict):
        return None, "a line must be a JSON object"
    if "messages" in record:
        extra = sorted(set(record) - {"messages", "tools"})
        if extra:
            return None, f"unknown key(s) {extra} next to 'messages'"
        reason = _reason_for_messages(record["messages"])
        tools = record.get("tools")
        if reason is None and tools is not None:
            reason = tools_reason(tools)
        if reason is not None:
            return None, reason
        messages = [_kept(m) for m in record["messages"]]
        return Conversation(messages, tools or None), None
    if "prompt" in record or "response" in record:
        extra = sorted(set(record) - {"prompt", "response"})
        if extra:
            return None, f"unknown key(s) {extra} next to 'prompt'/'response'"
        for key in ("prompt", "response"):
            value = record.get(key)
            if not isinstance(value, str):
                return None, f"'{key}' must be a string"
            if not value.strip():
                suffix = " (no assistant turn)" if key == "response" else ""
                return None, f"'{key}' is empty{suffix}"
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
        return Conversation(messages), None
    return None, "expected a 'messages' list or 'prompt'/'response' strings"


def _kept(message: dict[str, Any]) -> dict[str, Any]:
    """A valid message as it is stored and rendered: as given, less its null values
    (transformers leaves them out before a render) and an empty list of calls (no calls)."""
    return {k: v for k, v in message.items() if v is not None and not (k == "tool_calls" and not v)}


def parse_line(
    raw: bytes | str, *, source: str, line_no: int, shape: RecordShape | None = None
) -> Conversation:
    """Parse and validate one JSONL line (read through ``shape``, a NeMo RL data set shape,
    when given); raise `BadRecordError` naming the line."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRecordError(source, line_no, f"invalid JSON ({exc})") from None
    if shape is not None:
        record, reason = shape.messages_record(record)
        if reason is not None:
            raise BadRecordError(source, line_no, reason)
    conversation, reason = normalize_record(record)
    if reason is not None:
        raise BadRecordError(source, line_no, reason)
    assert conversation is not None
    return conversation

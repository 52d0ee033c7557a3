"""Validation of one JSONL conversation record.

`prepare-data` checks every input line before anything is written, and the task encoder reads
the same normalized shape back from the shards, so the rules live in one place: a record is
either ``{"messages": [{"role", "content"}, ...]}`` or ``{"prompt", "response"}``; roles are
system, user or assistant; contents are non-empty strings; at least one assistant turn.
"""

from __future__ import annotations

from typing import Any

import orjson

from sft_runtime.runtime.data.record_shapes import RecordShape
from sft_runtime.runtime.errors import UserInputError

ROLES = ("system", "user", "assistant")


class BadRecordError(UserInputError):
    """A JSONL line that is not a valid conversation; the message names the file and line."""

    def __init__(self, source: str, line_no: int, reason: str) -> None:
        super().__init__(f"{source}:{line_no}: {reason}")
        self.source = source
        self.line_no = line_no
        self.reason = reason


def _reason_for_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    has_assistant = False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object"
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            return f"messages[{index}] has unknown key(s) {unknown}"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{index}].role {role!r} is not one of {list(ROLES)}"
        content = message.get("content")
        if not isinstance(content, str):
            return f"messages[{index}].content must be a string"
        if not content.strip():
            return f"messages[{index}].content is empty"
        has_assistant = has_assistant or role == "assistant"
    if not has_assistant:
        return "no assistant turn"
    return None


def normalize_record(record: Any) -> tuple[list[dict[str, str]] | None, str | None]:
    """Return (messages, None) for a valid record or (None, reason) for an invalid one."""
    if not isinstance(record, dict):
        return None, "a line must be a JSON object"
    if "messages" in record:
        extra = sorted(set(record) - {"messages"})
        if extra:
            return None, f"unknown key(s) {extra} next to 'messages'"
        reason = _reason_for_messages(record["messages"])
        if reason is not None:
            return None, reason
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]], None
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
        return messages, None
    return None, "expected a 'messages' list or 'prompt'/'response' strings"


def parse_line(
    raw: bytes | str, *, source: str, line_no: int, shape: RecordShape | None = None
) -> list[dict[str, str]]:
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
    messages, reason = normalize_record(record)
    if reason is not None:
        raise BadRecordError(source, line_no, reason)
    assert messages is not None
    return messages

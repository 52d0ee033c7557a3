"""JSONL records in NeMo RL's data set shapes, turned into this runtime's conversations.

NeMo RL reads a local JSONL file as ``openai_format`` (a list of chat messages under
``chat_key``, an optional system message under ``system_key`` or a fixed ``system_prompt``,
tool definitions under ``tool_key``) or as ``ResponseDataset`` (one prompt under
``input_key`` and its answer under ``output_key``). `RecordShape.messages_record` maps one
such record onto ``{"messages": [...], "tools": [...]}`` (tools only where the record has
some), which `records.normalize_record` then checks as it checks every conversation; keys
the shape does not read are ignored, as NeMo RL ignores them. Tool calling is read as NeMo
RL reads it (chat_format.py): the tools list goes beside the messages, and a message keeps
its calls (an assistant's ``tool_calls``) or what names the call it answers (a tool's
``tool_call_id`` and ``name``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sft_runtime.runtime.data.chat_format import tool_calls_reason, tools_reason

DatasetName = Literal["openai_format", "ResponseDataset"]


@dataclass(frozen=True)
class RecordShape:
    """How one record of a NeMo RL data file reads (NeMo RL's keys and defaults)."""

    dataset_name: DatasetName = "openai_format"
    chat_key: str = "messages"
    system_key: str | None = None
    system_prompt: str | None = None
    tool_key: str | None = "tools"  # None: the records' tools are not read (NeMo RL's)
    input_key: str = "input"
    output_key: str = "output"

    def messages_record(self, record: Any) -> tuple[dict[str, Any] | None, str | None]:
        """(``{"messages": [...]}`` with the record's ``"tools"`` when it has some, None),
        or (None, why the record does not read)."""
        if not isinstance(record, dict):
            return None, "a line must be a JSON object"
        tools = None
        if self.dataset_name == "ResponseDataset":
            for key in (self.input_key, self.output_key):
                if not isinstance(record.get(key), str):
                    return None, f"{key!r} must be a string (ResponseDataset)"
            messages: list[Any] = [
                {"role": "user", "content": record[self.input_key]},
                {"role": "assistant", "content": record[self.output_key]},
            ]
        else:
            messages = record.get(self.chat_key)
            if not isinstance(messages, list):
                return None, f"{self.chat_key!r} must be a list of messages (openai_format)"
            tools = record.get(self.tool_key) if self.tool_key is not None else None
            if tools is not None and (reason := tools_reason(tools, self.tool_key)):
                return None, reason
            if reason := self._calls_reason(messages):
                return None, reason
            messages = [_message(m) for m in messages]
        has_system = any(isinstance(m, dict) and m.get("role") == "system" for m in messages)
        system = record.get(self.system_key) if self.system_key else None
        if system is not None and not has_system:
            if not isinstance(system, str):
                return None, f"{self.system_key!r} must be a string"
            messages = [{"role": "system", "content": system}, *messages]
        elif self.system_prompt is not None and not has_system:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        out: dict[str, Any] = {"messages": messages}
        if tools:
            out["tools"] = tools
        return out, None

    def _calls_reason(self, messages: list[Any]) -> str | None:
        """Why an assistant's ``tool_calls`` do not read, named where the record has them
        (records.py checks the rest once a system message may have been put first)."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") != "assistant":
                continue
            calls = message.get("tool_calls")
            if calls is not None and (
                reason := tool_calls_reason(calls, f"{self.chat_key}[{i}].tool_calls")
            ):
                return reason
        return None


# What a message of each role keeps besides its role and content (chat_format.py).
_TOOL_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}


def _message(message: Any) -> Any:
    """A chat message with the keys a conversation holds: role, content and, for tool
    calling, an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` and
    ``name``; OpenAI's other optional keys (a user's ``name``, ``refusal``) are dropped."""
    if not isinstance(message, dict):
        return message
    role = message.get("role")
    kept = ("role", "content", *(_TOOL_KEYS.get(role, ()) if isinstance(role, str) else ()))
    return {k: v for k, v in message.items() if k in kept}

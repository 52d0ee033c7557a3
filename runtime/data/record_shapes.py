"""JSONL records in NeMo RL's data set shapes, turned into this runtime's conversations.

NeMo RL reads a local JSONL file as ``openai_format`` (a list of chat messages under
``chat_key``, an optional system message under ``system_key`` or a fixed ``system_prompt``,
tool definitions under ``tool_key``) or as ``ResponseDataset`` (one prompt under
``input_key`` and its answer under ``output_key``). `RecordShape.messages_record` maps one
such record onto ``{"messages": [...]}``, which `records.normalize_record` then checks as
it checks every conversation; keys the shape does not read are ignored, as NeMo RL ignores
them. Tool calling is not supported: a record that carries tools or tool calls is a bad
line that says so, never a conversation trained without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

DatasetName = Literal["openai_format", "ResponseDataset"]


@dataclass(frozen=True)
class RecordShape:
    """How one record of a NeMo RL data file reads (NeMo RL's keys and defaults)."""

    dataset_name: DatasetName = "openai_format"
    chat_key: str = "messages"
    system_key: str | None = None
    system_prompt: str | None = None
    tool_key: str = "tools"
    input_key: str = "input"
    output_key: str = "output"

    def messages_record(self, record: Any) -> tuple[dict[str, Any] | None, str | None]:
        """(``{"messages": [...]}``, None), or (None, why the record does not read)."""
        if not isinstance(record, dict):
            return None, "a line must be a JSON object"
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
            if record.get(self.tool_key):
                return None, f"{self.tool_key!r}: tool calling is not supported"
            for i, message in enumerate(messages):
                if isinstance(message, dict) and (
                    message.get("tool_calls") or message.get("role") == "tool"
                ):
                    return None, f"{self.chat_key}[{i}]: tool calling is not supported"
            messages = [_message(m) for m in messages]
        has_system = any(isinstance(m, dict) and m.get("role") == "system" for m in messages)
        system = record.get(self.system_key) if self.system_key else None
        if system is not None and not has_system:
            if not isinstance(system, str):
                return None, f"{self.system_key!r} must be a string"
            messages = [{"role": "system", "content": system}, *messages]
        elif self.system_prompt is not None and not has_system:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return {"messages": messages}, None


def _message(message: Any) -> Any:
    """A chat message with the keys a conversation holds (OpenAI's optional ones, such as
    ``name`` or a null ``tool_calls``, dropped)."""
    if not isinstance(message, dict):
        return message
    return {k: v for k, v in message.items() if k in ("role", "content")}

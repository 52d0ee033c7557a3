"""Tool calling in a conversation, as NeMo RL's ``openai_format`` data carries it.

A record may hold the tools the model could call (a list of JSON function schemas under
``data.*.tool_key``, default ``tools``), assistant messages that call them (``tool_calls``
in OpenAI's shape: ``[{"type": "function", "function": {"name": ..., "arguments": ...}}]``,
the arguments an object or a JSON string holding one) and ``tool`` messages with a call's
result (``content``, optionally ``tool_call_id`` and ``name``). They reach the chat
template as NeMo RL's sft_processor passes them, ``apply_chat_template(messages,
tools=tools)`` with the messages as given, for every render of the conversation.

What is trained on follows from that (chat_template.py): an assistant message is supervised
as the template renders it, its calls included; a tool's result is another message's
text, and the tool definitions are what the template writes into the system or prompt
area, so both are context. The byte tokenizer's layout has no place for tools: its
conversations are refused (tokenizer.py), a data file's naming the line (bring.py).

An empty or null ``tools`` list, and an empty or null ``tool_calls``, is no tools, as
before tool calling was read: a file prepared earlier keeps the folder it was prepared
into. The checks here name what is wrong in one line; records.py puts the line's file
and number in front.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

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

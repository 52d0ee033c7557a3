"""Tool-calling conversations and a Qwen-style chat template that renders them, for tests.

`TOOL_TEMPLATE_MARKED` writes the tool definitions into the system block (a default system
prompt when the conversation has none), an assistant's calls as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` after its text, and the results
of consecutive tool messages in one user turn of ``<tool_response>`` blocks, as Qwen2.5's
template does; ``{% generation %}`` marks each assistant reply with its calls and its
``<|im_end|>``, so transformers' ``return_assistant_tokens_mask`` says which tokens are the
assistant's. `TOOL_TEMPLATE` is the same template without the markers: what a hub template
looks like, whose turns must be found from renders.

`tool_conversation` draws OpenAI-shaped records: a call alone (content null) or after
text, two calls answered by two tool messages, arguments as an object or a JSON string,
``tool_call_id`` and ``name`` on the results, and conversations that call nothing.
"""

from __future__ import annotations

import json
import random
from typing import Any

GENERATION, END_GENERATION = "{%- generation -%}", "{%- endgeneration -%}"

TOOL_TEMPLATE_MARKED = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] -}}"
    "{%- else -%}"
    "{{- 'You are a helpful assistant.' -}}"
    "{%- endif -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call these functions:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each call, answer with <tool_call></tool_call>.<|im_end|>\\n' -}}"
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}" + GENERATION + "{%- if message['content'] -%}"
    "{{- message['content'] -}}"
    "{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{%- if call['function']['arguments'] is string -%}"
    "{{- call['function']['arguments'] -}}"
    "{%- else -%}"
    "{{- call['function']['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}" + END_GENERATION + "{{- '\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TOOL_TEMPLATE = TOOL_TEMPLATE_MARKED.replace(GENERATION, "").replace(END_GENERATION, "")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city today.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city."}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "The sum of two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
CITIES = ("Paris", "Oslo", "Lima", "Kyoto", "Cairo", "Quito")
SKIES = ("sunny", "rainy", "cloudy", "windy")


def _call(name: str, arguments: dict[str, Any], as_string: bool, call_id: str) -> dict:
    args: Any = json.dumps(arguments) if as_string else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def tool_conversation(rng: random.Random) -> dict[str, Any]:
    """One openai_format record (``messages`` and, mostly, ``tools``) that calls a tool
    once, twice in one turn, or not at all."""
    kind = rng.choice(("weather", "sum", "two_cities", "no_call"))
    as_string = rng.random() < 0.5
    city, other = rng.sample(CITIES, 2)
    sky, other_sky = rng.choice(SKIES), rng.choice(SKIES)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if kind == "weather":
        call = _call("get_weather", {"city": city}, as_string, "call_1")
        messages = [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": sky},
            {"role": "assistant", "content": f"It is {sky} in {city} today."},
        ]
    elif kind == "sum":
        call = _call("add", {"a": a, "b": b}, as_string, "call_1")
        messages = [
            {"role": "system", "content": "You are a careful calculator."},
            {"role": "user", "content": f"Add {a} and {b}."},
            {"role": "assistant", "content": "I will use the add tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": str(a + b)},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}"},
        ]
    elif kind == "two_cities":
        calls = [
            _call("get_weather", {"city": city}, as_string, "call_1"),
            _call("get_weather", {"city": other}, not as_string, "call_2"),
        ]
        messages = [
            {"role": "user", "content": f"Compare the weather in {city} and {other}."},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": sky},
            {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": other_sky},
            {"role": "assistant", "content": f"{city} is {sky}, {other} is {other_sky}."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You are welcome."},
        ]
    else:
        messages = [
            {"role": "user", "content": f"Say hello to {city}."},
            {"role": "assistant", "content": f"Hello, {city}!"},
        ]
    record: dict[str, Any] = {"messages": messages}
    if kind != "no_call" or rng.random() < 0.5:
        record["tools"] = TOOLS
    return record


def tool_records(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [tool_conversation(rng) for _ in range(count)]


def tool_texts(count: int = 100, seed: int = 1) -> list[str]:
    """The tool conversations as text, for a test tokenizer's BPE merges to learn from."""
    texts = []
    for record in tool_records(count, seed):
        lines = [json.dumps(tool) for tool in record.get("tools", [])]
        for message in record["messages"]:
            lines.append(message.get("content") or "")
            lines += [json.dumps(call["function"]) for call in message.get("tool_calls", [])]
        texts.append("\n".join(lines))
    return texts

"""NeMo RL's SFT rows, built as its ``sft_processor`` builds them, to hold ours against.

NeMo RL (``get_formatted_message_log``) renders the messages up to each message with the
tokenizer's ``apply_chat_template`` (with the generation prompt after a user message when
``add_generation_prompt``), takes what that render adds to the previous one as the message's
chunk, puts the BOS before the first chunk and the EOS after the last when they are missing,
tokenizes every chunk on its own and trains on the assistant messages' tokens. Written here
from that description, for tests only: the runtime's own code is never called.
"""

from __future__ import annotations

from typing import Any

# A Llama-3-like layout that emits neither BOS nor EOS (turns end with a newline), so that
# data.add_bos and data.add_eos both have something to add.
BARE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)


def first_difference(a: str, b: str) -> int:
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return min(len(a), len(b))


def nemo_rl_row(
    tok: Any,
    template: str,
    messages: list[dict[str, str]],
    *,
    add_bos: bool,
    add_eos: bool,
    add_generation_prompt: bool,
    prompt: str | None = None,
) -> tuple[list[int], list[float]]:
    """(ids, loss mask) of `messages` under NeMo RL's rules; `prompt` is a prompt file's
    text, put around the first user message. The mask's first entry is 0 (no token before
    it to predict it from), as in both runtimes."""
    if prompt is not None:
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        content = prompt.format(messages[first_user]["content"])
        before, after = messages[:first_user], messages[first_user + 1 :]
        messages = [*before, {"role": "user", "content": content}, *after]
    ids: list[int] = []
    targets: list[bool] = []
    previous = ""
    for i, message in enumerate(messages):
        rendered = tok.apply_chat_template(
            messages[: i + 1],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and message["role"] == "user",
        )
        chunk = rendered[first_difference(previous, rendered) :]
        if i == 0 and add_bos and tok.bos_token and not chunk.startswith(tok.bos_token):
            chunk = tok.bos_token + chunk
        last = i == len(messages) - 1
        if last and add_eos and not chunk.rstrip("\n").endswith(tok.eos_token):
            chunk += tok.eos_token
        piece = tok(chunk, add_special_tokens=False)["input_ids"]
        ids += piece
        targets += [message["role"] == "assistant"] * len(piece)
        previous = rendered
    return ids, [0.0] + [1.0 if t else 0.0 for t in targets[1:]]

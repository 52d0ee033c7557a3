"""NeMo RL's ``prompt_file``: a format string the first user message is put into.

NeMo RL reads the file once (``TaskDataSpec``) and, for every conversation, replaces the
content of the first user message (system messages before it are skipped) with
``prompt.format(content)``. The same happens here before the conversation is rendered, for
every data source (a prepared data set or a data file). A prompt without a ``{}`` would
drop the user's message, and one with named fields cannot be filled: both are refused when
the config is read, naming the key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


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

"""Tokenizers and the chat template.

The default tokenizer is byte level: ids 0-255 are UTF-8 bytes, then PAD, BOS, EOS and one
marker per role. It needs no files and no downloads, so tests, the demo and CI all run
offline, and its `identity()` is a constant that goes into loader fingerprints (a resume with
a different tokenizer would silently change every batch).

Its chat template: ``BOS`` then per message ``<role> content EOS``. The supervised part of an
assistant message is its content and its closing EOS (the model must learn to stop); role
markers and everything said by system and user are context. The layout has BOS and EOS
already, so ``data.add_bos`` and ``data.add_eos`` add nothing; the assistant marker is the
header that ``data.add_generation_prompt: false`` trains on (chat_format.py). It has no
layout for tool calling (chat_format.py): a conversation with tools, tool calls or tool
results is refused, never trained on without them.

A Hugging Face tokenizer renders conversations with its own chat template (or the one
``policy.tokenizer.chat_template`` supplies) and is supervised on the assistant turns as that
template renders them: see chat_template.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, field_serializer, model_validator

from sft_runtime.runtime.data import chat_template as hf_chat
from sft_runtime.runtime.data.chat_format import (
    BYTE_REFUSAL,
    RENDERED_FORMAT,
    ChatFormat,
    uses_tools,
)
from sft_runtime.runtime.errors import UserInputError

PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""NeMo RL's ``chat_template: null``: the messages' contents back to back, no markup."""


class TokenizerSpec(BaseModel):
    """NeMo RL's ``policy.tokenizer``: ``name`` is a local Hugging Face tokenizer folder, or
    ``byte`` (this runtime's built-in byte-level tokenizer, which needs no files).

    ``chat_template`` as NeMo RL reads it: left out or ``default``, the tokenizer's own; a
    path ending in ``.jinja``, that file's text; ``null``, a passthrough of the messages'
    contents (`PASSTHROUGH_TEMPLATE`); anything else, Jinja source. Once read it is None (the
    tokenizer's own, written back as ``default``) or the Jinja source.
    ``chat_template_kwargs`` are the template variables every render gets, as keyword
    arguments of ``apply_chat_template`` (``{enable_thinking: false}`` for Qwen3).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "byte"
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nemo_rl_shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "path" in data or data.get("name") == "huggingface":
            raise ValueError(
                "policy.tokenizer.path: NeMo RL's name for the tokenizer's folder is "
                "policy.tokenizer.name (by default policy.model_name's)"
            )
        if "chat_template" not in data:
            return data
        template = data["chat_template"]
        if template is None:
            template = PASSTHROUGH_TEMPLATE
        elif template == "default":
            template = None
        elif isinstance(template, str) and template.endswith(".jinja") and "{" not in template:
            try:
                template = Path(template).read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(
                    f"policy.tokenizer.chat_template {template!r}: {exc.strerror or exc}"
                ) from None
        return {**data, "chat_template": template}

    @field_serializer("chat_template")
    def _own_is_default(self, template: str | None) -> str:
        return "default" if template is None else template

    @property
    def is_byte(self) -> bool:
        return self.name == "byte"

    @property
    def path(self) -> str | None:
        """The Hugging Face tokenizer's folder (None for the byte tokenizer)."""
        return None if self.is_byte else self.name

    @model_validator(mode="after")
    def _byte_has_its_own(self) -> TokenizerSpec:
        if self.is_byte and self.chat_template is not None:
            raise ValueError(
                "policy.tokenizer.chat_template is only valid with a Hugging Face tokenizer "
                "(the byte tokenizer has a fixed template)"
            )
        return self

    @model_validator(mode="after")
    def _template_kwargs_are_variables(self) -> TokenizerSpec:
        kwargs = self.chat_template_kwargs
        if kwargs is None:
            return self
        if self.is_byte:
            raise ValueError(
                f"{KWARGS_KEY} is only valid with a Hugging Face tokenizer (the byte "
                "tokenizer has a fixed template)"
            )
        taken = sorted(set(kwargs) & hf_chat.RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(
                f"{KWARGS_KEY}: {', '.join(taken)} are arguments of apply_chat_template "
                "itself, not template variables"
            )
        try:
            kwargs_digest(kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{KWARGS_KEY} must be plain JSON values: {exc}") from None
        return self


KWARGS_KEY = "policy.tokenizer.chat_template_kwargs"


def kwargs_digest(kwargs: dict[str, Any]) -> str:
    """A short stable digest of template variables (canonical JSON): part of the tokenizer's
    identity, because other variables render other ids for the same conversation."""
    text = json.dumps(kwargs, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class ChatTokenizer(Protocol):
    """What the task encoder (and a generation prompt) needs from a tokenizer."""

    vocab_size: int
    pad_id: int
    eos_id: int

    def identity(self) -> str: ...

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        only_unmask_final: bool = False,
        chat_format: ChatFormat | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], list[bool]]: ...

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes plus special tokens; deterministic, offline, tiny vocabulary."""

    ROLES = ("system", "user", "assistant")

    def __init__(self) -> None:
        self.pad_id = 256
        self.bos_id = 257
        self.eos_id = 258
        self._role_ids = {role: 259 + i for i, role in enumerate(self.ROLES)}
        self.vocab_size = 259 + len(self.ROLES)

    def identity(self) -> str:
        """Stable description of the vocabulary, used in loader fingerprints."""
        return f"byte-v1:vocab={self.vocab_size}:pad={self.pad_id}"

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def role_id(self, role: str) -> int:
        return self._role_ids[role]

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        only_unmask_final: bool = False,
        chat_format: ChatFormat | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation and, per token, whether it belongs to a supervised
        reply (only the last one with `only_unmask_final`).

        The layout already opens with BOS and closes every message with EOS, so
        `chat_format`'s ``add_bos`` and ``add_eos`` find nothing to add; an assistant
        message's role marker is its header, trained on where `chat_format` says so.
        Tool calling has no layout here: `tools`, a call or a tool's result is a
        ValueError (module doc)."""
        if uses_tools(messages, tools):
            raise ValueError(BYTE_REFUSAL)
        fmt = chat_format or RENDERED_FORMAT
        last_assistant = max(
            (i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1
        )
        ids = [self.bos_id]
        supervised = [False]
        for index, message in enumerate(messages):
            role = message["role"]
            body = self.encode_text(message["content"]) + [self.eos_id]
            train = role == "assistant" and (not only_unmask_final or index == last_assistant)
            ids.append(self.role_id(role))
            supervised.append(train and fmt.header_supervised(messages, index))
            ids.extend(body)
            supervised.extend([train] * len(body))
        return ids, supervised

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """`messages` as context, then the assistant marker the reply follows."""
        ids, _ = self.encode_chat(messages)
        return ids + [self.role_id("assistant")]

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special tokens are shown as ``<name>`` (for debugging)."""
        names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        names.update({v: f"<{k}>" for k, v in self._role_ids.items()})
        out: list[str] = []
        chunk = bytearray()
        for token in ids:
            if token < 256:
                chunk.append(token)
                continue
            out.append(chunk.decode("utf-8", errors="replace"))
            chunk.clear()
            out.append(names.get(token, f"<{token}>"))
        out.append(chunk.decode("utf-8", errors="replace"))
        return "".join(out)


class HFChatTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloads), rendering
    conversations with its chat template or `chat_template`, which overrides it, and
    `chat_template_kwargs` as template variables.

    The template is checked once here, so a tokenizer that has none, or one that cannot
    render a user/assistant chat, fails at start-up naming ``policy.tokenizer.chat_template``.
    """

    def __init__(
        self,
        path: str,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise UserInputError(
                "a Hugging Face tokenizer (policy.tokenizer.name) needs the 'transformers' package"
            ) from exc
        if not Path(path).is_dir():
            raise UserInputError(f"policy.tokenizer.name {path!r}: not a local directory")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if not self._tok.is_fast:
            raise UserInputError(
                f"policy.tokenizer.name {path!r}: a fast (tokenizer.json) tokenizer is needed, "
                "its offsets map the chat template's assistant turns onto tokens"
            )
        eos = self._tok.eos_token_id
        if eos is None:
            raise UserInputError(f"policy.tokenizer.name {path!r}: tokenizer has no EOS token")
        self.eos_id = int(eos)
        bos = self._tok.bos_token_id
        self.bos_id: int | None = None if bos is None else int(bos)
        self.pad_id = int(self._tok.pad_token_id if self._tok.pad_token_id is not None else eos)
        self.vocab_size = len(self._tok)
        template = hf_chat.resolve_template(self._tok, chat_template, path=path)
        self._chat = hf_chat.ChatTemplate(self._tok, template, chat_template_kwargs)
        hf_chat.check_template(self._chat, path=path)
        digest = hashlib.sha256(str(sorted(self._tok.get_vocab().items())).encode()).hexdigest()
        self._identity = (
            f"hf:{Path(path).name}:vocab={self.vocab_size}:{digest[:16]}"
            f":template={hf_chat.template_digest(template)}"
        )
        if chat_template_kwargs:  # none: the identity runs recorded before the variables
            self._identity += f":template_kwargs={kwargs_digest(chat_template_kwargs)}"

    @property
    def chat_template(self) -> str:
        """The Jinja source that renders conversations (the spec's, else the tokenizer's)."""
        return self._chat.template

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        """The template variables every render gets (a copy)."""
        return dict(self._chat.template_kwargs)

    @property
    def hf_tokenizer(self) -> Any:
        """The underlying transformers tokenizer (for generation and export code)."""
        return self._tok

    def identity(self) -> str:
        return self._identity

    def encode_text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        only_unmask_final: bool = False,
        chat_format: ChatFormat | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], list[bool]]:
        """Ids as ``apply_chat_template(messages, tools=tools, tokenize=True)`` gives them,
        with the BOS and EOS `chat_format` adds, and which of them are the assistant turns'
        (see chat_template.py and chat_format.py)."""
        return self._chat.tokenize(
            messages, only_unmask_final=only_unmask_final, chat_format=chat_format, tools=tools
        )

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self._chat.encode_prompt(messages)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


TOKENIZER_CONFIG = "tokenizer_config.json"
# What `save_pretrained` writes for the tokenizer families transformers knows (no weights).
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Template files win over tokenizer_config.json's key when transformers loads a folder.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def save_tokenizer(spec: TokenizerSpec | dict | None, directory: str | Path) -> list[str]:
    """Put the run's tokenizer into a checkpoint, so the checkpoint alone says how its ids
    were made (and an export can ship it): a Hugging Face tokenizer's files are copied as
    they are, except that a ``chat_template`` from the spec replaces the folder's template
    (written into tokenizer_config.json, template files left out, so
    ``AutoTokenizer.from_pretrained`` on the copy renders what training rendered); the byte
    tokenizer, which has no files, is described by its config and identity. Returns the
    files written.

    ``chat_template_kwargs`` have no place in a tokenizer folder: transformers reads no
    default template variables from it, so a render of the copy must be given them again.
    They are in the checkpoint's config.yaml (``policy.tokenizer.chat_template_kwargs``)."""
    spec = TokenizerSpec.model_validate(spec or {})
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if spec.is_byte:
        info = {"name": "byte", "identity": ByteTokenizer().identity()}
        path = out / TOKENIZER_CONFIG
        path.write_text(json.dumps(info, indent=2, sort_keys=True))
        return [str(path)]
    source = Path(spec.path or "")
    found = [source / name for name in HF_TOKENIZER_FILES if (source / name).is_file()]
    if not found:
        raise UserInputError(
            f"policy.tokenizer.name {str(source)!r}: none of the tokenizer files "
            f"({', '.join(HF_TOKENIZER_FILES)}) is there"
        )
    if spec.chat_template is not None:
        found = [f for f in found if f.name not in TEMPLATE_FILES]
    written = []
    for file in found:
        shutil.copyfile(file, out / file.name)
        written.append(str(out / file.name))
    if spec.chat_template is not None:
        config_path = out / TOKENIZER_CONFIG
        text = config_path.read_text(encoding="utf-8") if config_path.is_file() else "{}"
        config = json.loads(text)
        config["chat_template"] = spec.chat_template
        config_path.write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        if str(config_path) not in written:
            written.append(str(config_path))
    return written


def build_tokenizer(spec: TokenizerSpec | None = None) -> ChatTokenizer:
    """Build the tokenizer a `TokenizerSpec` names (byte level when `spec` is None)."""
    spec = spec or TokenizerSpec()
    if spec.is_byte:
        return ByteTokenizer()
    assert spec.path is not None
    return HFChatTokenizer(
        spec.path,
        chat_template=spec.chat_template,
        chat_template_kwargs=spec.chat_template_kwargs,
    )


def apply_chat_template(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    *,
    only_unmask_final: bool = False,
    chat_format: ChatFormat | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and, per token, whether it belongs to a supervised reply,
    in the tokenizer's own template (the byte layout, or a Hugging Face chat template, with
    the conversation's `tools`) under `chat_format`'s rules (its defaults when None).

    With `only_unmask_final` only the last assistant message is supervised; with no
    assistant message nothing is.
    """
    return tokenizer.encode_chat(
        messages, only_unmask_final=only_unmask_final, chat_format=chat_format, tools=tools
    )

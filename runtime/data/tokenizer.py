"""Tokenizers and the chat template.

The default tokenizer is byte level: ids 0-255 are UTF-8 bytes, then PAD, BOS, EOS and one
marker per role. It needs no files and no downloads, so tests, the demo and CI all run
offline, and its `identity()` is a constant that goes into loader fingerprints (a resume with
a different tokenizer would silently change every batch).

Chat template, for every tokenizer: ``BOS`` then per message ``<role> content EOS``. The
supervised part of an assistant message is its content and its closing EOS (the model must
learn to stop); role markers and everything said by system and user are context.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, model_validator

from sft_runtime.runtime.errors import UserInputError


class TokenizerSpec(BaseModel):
    """Which tokenizer to build: ``name="byte"`` or a local Hugging Face ``path``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["byte", "huggingface"] = "byte"
    path: str | None = None

    @model_validator(mode="after")
    def _path_matches_name(self) -> TokenizerSpec:
        if self.name == "huggingface" and not self.path:
            raise ValueError("tokenizer.path is required when tokenizer.name is 'huggingface'")
        if self.name == "byte" and self.path:
            raise ValueError("tokenizer.path is only valid with tokenizer.name 'huggingface'")
        return self


class ChatTokenizer(Protocol):
    """What the task encoder needs from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def identity(self) -> str: ...

    def encode_text(self, text: str) -> list[int]: ...

    def role_id(self, role: str) -> int: ...


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
    """A Hugging Face tokenizer loaded from a local directory (never downloads).

    Role markers are the tokenizer's encodings of ``<|role|>`` collapsed to their first id,
    BOS/EOS/PAD fall back to EOS when missing.
    """

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise UserInputError(
                "tokenizer.name 'huggingface' needs the 'transformers' package"
            ) from exc
        if not Path(path).is_dir():
            raise UserInputError(f"tokenizer.path {path!r}: not a local directory")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        eos = self._tok.eos_token_id
        if eos is None:
            raise UserInputError(f"tokenizer.path {path!r}: tokenizer has no EOS token")
        self.eos_id = int(eos)
        self.bos_id = int(self._tok.bos_token_id if self._tok.bos_token_id is not None else eos)
        self.pad_id = int(self._tok.pad_token_id if self._tok.pad_token_id is not None else eos)
        self.vocab_size = len(self._tok)
        self._roles = {
            r: self._tok.encode(f"<|{r}|>", add_special_tokens=False)[0]
            for r in ByteTokenizer.ROLES
        }
        digest = hashlib.sha256(str(sorted(self._tok.get_vocab().items())).encode()).hexdigest()
        self._identity = f"hf:{Path(path).name}:vocab={self.vocab_size}:{digest[:16]}"

    def identity(self) -> str:
        return self._identity

    def encode_text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def role_id(self, role: str) -> int:
        return int(self._roles[role])


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


def save_tokenizer(spec: TokenizerSpec | dict | None, directory: str | Path) -> list[str]:
    """Put the run's tokenizer into a checkpoint, so the checkpoint alone says how its ids
    were made (and an export can ship it): a Hugging Face tokenizer's files are copied as
    they are; the byte tokenizer, which has no files, is described by its config and
    identity. Returns the files written."""
    spec = TokenizerSpec.model_validate(spec or {})
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if spec.name == "byte":
        info = {"name": "byte", "identity": ByteTokenizer().identity()}
        path = out / TOKENIZER_CONFIG
        path.write_text(json.dumps(info, indent=2, sort_keys=True))
        return [str(path)]
    source = Path(spec.path or "")
    found = [source / name for name in HF_TOKENIZER_FILES if (source / name).is_file()]
    if not found:
        raise UserInputError(
            f"tokenizer.path {str(source)!r}: none of the tokenizer files "
            f"({', '.join(HF_TOKENIZER_FILES)}) is there"
        )
    written = []
    for file in found:
        shutil.copyfile(file, out / file.name)
        written.append(str(out / file.name))
    return written


def build_tokenizer(spec: TokenizerSpec | None = None) -> ChatTokenizer:
    """Build the tokenizer a `TokenizerSpec` names (byte level when `spec` is None)."""
    spec = spec or TokenizerSpec()
    if spec.name == "byte":
        return ByteTokenizer()
    assert spec.path is not None
    return HFChatTokenizer(spec.path)


def apply_chat_template(
    tokenizer: ChatTokenizer, messages: list[dict[str, str]], *, only_unmask_final: bool = False
) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and, per token, whether it belongs to a supervised reply.

    With `only_unmask_final` only the last assistant message is supervised.
    """
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = [tokenizer.bos_id]
    supervised = [False]
    for index, message in enumerate(messages):
        role = message["role"]
        body = tokenizer.encode_text(message["content"]) + [tokenizer.eos_id]
        train = role == "assistant" and (not only_unmask_final or index == last_assistant)
        ids.append(tokenizer.role_id(role))
        supervised.append(False)
        ids.extend(body)
        supervised.extend([train] * len(body))
    return ids, supervised

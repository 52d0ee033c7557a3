"""Hydra-style overrides, as NeMo RL's launch scripts take them after the config file.

``a.b=value`` sets a key (an unknown one is then refused by the config's own check, with a
did-you-mean), ``+a.b=value`` adds a key the config does not have, ``++a.b=value`` sets
whether or not it is there, and ``~a.b`` removes a key (so its default applies). A value is
read as YAML (``3``, ``1e-5``, ``null``, ``[a, b]``); an interpolation such as
``${policy.max_total_sequence_length}`` is kept as text and resolved with the rest.
"""

from __future__ import annotations

from typing import Any

import yaml

from sft_runtime.runtime.config_files.yaml_numbers import load_yaml
from sft_runtime.runtime.errors import UserInputError


def apply_overrides(raw: dict[str, Any], items: list[str] | tuple[str, ...]) -> None:
    for item in items:
        apply_override(raw, item)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one override to the nested mapping ``raw`` in place."""
    if item.startswith("~"):
        key, _, _ = item[1:].partition("=")
        _delete(raw, _path(key, item), item)
        return
    mode = "++" if item.startswith("++") else "+" if item.startswith("+") else ""
    key, sep, text = item[len(mode) :].partition("=")
    if not sep:
        raise UserInputError(f"override {item!r}: expected dotted.key=value (or ~dotted.key)")
    parts = _path(key, item)
    node = _parent(raw, parts, item)
    if mode == "+" and parts[-1] in node:
        raise UserInputError(
            f"override {item!r}: {key} is already set; use ++{key}=... to replace it"
        )
    node[parts[-1]] = _value(text)


def _path(key: str, item: str) -> list[str]:
    parts = key.split(".")
    if not key or any(not part for part in parts):
        raise UserInputError(f"override {item!r}: expected dotted.key=value (or ~dotted.key)")
    return parts


def _parent(raw: dict[str, Any], parts: list[str], item: str) -> dict[str, Any]:
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserInputError(f"override {item!r}: {part} is not a section")
        node = child
    return node


def _delete(raw: dict[str, Any], parts: list[str], item: str) -> None:
    node: Any = raw
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or parts[-1] not in node:
        raise UserInputError(f"override {item!r}: {'.'.join(parts)} is not in the config")
    del node[parts[-1]]


def _value(text: str) -> Any:
    if not text:
        return ""
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return text

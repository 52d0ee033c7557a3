"""Refuse a YAML mapping that names a key twice.

YAML loaders keep the last of two equal keys without a word, so a config that sets
``sft.max_num_steps`` twice trains with the second value while the user reads the first.
`check_unique_keys` walks the composed node tree (no values are built, so it works beside
any loader: PyYAML's, OmegaConf's) and names the file, the line and the dotted key.
Merge keys (``<<: *anchor``) are YAML's own way of overriding and are left alone.
"""

from __future__ import annotations

import yaml

from sft_runtime.runtime.errors import UserInputError

_MERGE_TAG = "tag:yaml.org,2002:merge"


def check_unique_keys(text: str, source: str) -> None:
    """Raise `UserInputError` ``SOURCE line N: duplicate key 'a.b' (first at line M)`` for the
    first key a mapping in ``text`` repeats. ``text`` must already parse (this reports only
    duplicates)."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        _walk(root, (), source, set())


def _walk(node: yaml.Node, path: tuple[str, ...], source: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias shares its anchor's node: walk it once
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if key.tag == _MERGE_TAG:
                continue
            name = str(key.value)
            here = key.start_mark.line + 1
            if (key.tag, name) in first:
                dotted = ".".join((*path, name))
                raise UserInputError(
                    f"{source} line {here}: duplicate key {dotted!r} "
                    f"(first at line {first[key.tag, name]}); remove one of them"
                )
            first[key.tag, name] = here
            _walk(value, (*path, name), source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, (*path, str(i)), source, seen)

"""A config file and its ``defaults:`` chain, merged and resolved as NeMo RL resolves them.

NeMo RL's recipes start with ``defaults: ../../sft.yaml``: the named files (a string or a
list, each relative to the file that names it, each free to name its own defaults) are
merged first, in order, and the file itself over them. A mapping that says
``_override_: true`` replaces what the defaults hold there instead of merging into it.
Interpolations (``${policy.max_total_sequence_length}``, ``results/sft_${policy.model_name}``,
``${mul:${a},2}``) are resolved after the overrides are applied, so an override of a key
moves every value that refers to it; values are typed after resolution (``${mul:2,4}`` is the
integer 8). Every file is checked for duplicate keys before its values are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sft_runtime.runtime.config_files.overrides import apply_overrides
from sft_runtime.runtime.config_files.yaml_keys import check_unique_keys
from sft_runtime.runtime.config_files.yaml_numbers import load_yaml
from sft_runtime.runtime.errors import UserInputError

DEFAULTS_KEY = "defaults"
OVERRIDE_MARK = "_override_"

# NeMo RL's resolvers, plus their obvious siblings, registered once per process
_RESOLVERS = {
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "max": lambda *xs: max(xs),
    "min": lambda *xs: min(xs),
}


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_resolver(name, fn)


def read_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The plain, resolved mapping of ``path`` with its defaults and ``overrides`` applied."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register_resolvers()
    path = Path(path)
    raw = _compose(path, chain=())
    apply_overrides(raw, overrides)
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f"{key}: " if key else ""
        detail = str(exc).splitlines()[0]
        raise UserInputError(f"{path}: {where}cannot resolve an interpolation ({detail})") from None
    assert isinstance(resolved, dict)
    return resolved


def _compose(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """``path`` merged over its defaults, unresolved (interpolations stay as text)."""
    resolved_path = path.resolve()
    if resolved_path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved_path))
        raise UserInputError(f"{path}: its defaults chain comes back to itself ({cycle})")
    raw = _read_one(path)
    parents = raw.pop(DEFAULTS_KEY, None)
    if parents is None:
        return _strip_marks(raw)
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserInputError(
            f"{path}: {DEFAULTS_KEY}: expected a file name or a list of file names"
        )
    merged: dict[str, Any] = {}
    for parent in parents:
        parent_path = path.parent / parent
        merged = merge(merged, _compose(parent_path, (*chain, resolved_path)))
    return merge(merged, raw)


def _read_one(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserInputError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise UserInputError(f"{path}: a directory, not a config file") from None
    except OSError as exc:
        raise UserInputError(f"{path}: cannot read the config file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise UserInputError(f"{path}: not a text file (a YAML config is UTF-8 text)") from None
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", exc)
        raise UserInputError(f"{path}{where}: invalid YAML ({problem})") from None
    check_unique_keys(text, str(path))  # YAML would keep the second silently
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserInputError(f"{path}: the config must be a mapping of sections")
    return raw


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: mappings key by key, anything else replaced;
    a mapping of ``over`` marked ``_override_: true`` replaces ``base``'s whole."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and value.get(OVERRIDE_MARK) is True:
            out[key] = _strip_marks(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = _strip_marks(value) if isinstance(value, dict) else value
    return out


def _strip_marks(node: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (_strip_marks(v) if isinstance(v, dict) else v)
        for k, v in node.items()
        if k != OVERRIDE_MARK
    }

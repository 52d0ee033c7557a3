"""YAML read as OmegaConf reads NeMo RL's files: ``1e-5`` is a number.

PyYAML follows YAML 1.1, whose floats need a dot (``1.0e-5``), so ``eps: 1e-5`` in NeMo RL's
``sft.yaml`` (and ``lr=2e-5`` on a command line) would arrive as the string ``"1e-5"``.
OmegaConf's loader resolves such scalars as floats; `load_yaml` does the same, and is
otherwise PyYAML's safe loader.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class NumberLoader(yaml.SafeLoader):
    """PyYAML's safe loader with OmegaConf's float rule (an exponent without a dot)."""


NumberLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
NumberLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """``text`` parsed as a config (raises `yaml.YAMLError` as `yaml.safe_load` does)."""
    return yaml.load(text, Loader=NumberLoader)  # noqa: S506 - a SafeLoader subclass

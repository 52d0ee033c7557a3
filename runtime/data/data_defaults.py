"""NeMo RL's ``data.default``: keys every data set entry takes where it sets none itself.

NeMo RL fills each entry of ``data.train`` and ``data.validation`` with the keys of
``data.default`` it lacks (``update_single_dataset_config``), so one block can hold what all
data sets share: ``dataset_name``, ``input_key``, ``processor``, ``prompt_file`` and so on.
Here the same filling happens once, on the raw config, before the entries are validated: an
entry's own value always wins, a null entry (``validation: null``) stays null, and a key only
one kind of entry has (``split_validation_size``, the train entry's) goes to that one alone.
A key no entry has is refused, named as ``data.default.<key>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def fill_from_default(data: Any, entry_keys: Mapping[str, set[str]]) -> Any:
    """The raw ``data`` section with ``default`` applied to the entries named in
    `entry_keys` (entry -> the keys it accepts) and removed; anything that is not a
    mapping with a ``default`` is returned as it is (ValueError: one line naming the key)."""
    if not isinstance(data, Mapping) or "default" not in data:
        return data
    out = {key: value for key, value in data.items() if key != "default"}
    default = data["default"]
    if default is None:
        return out
    if not isinstance(default, Mapping):
        raise ValueError(
            "data.default: a mapping of data set keys that data.train and data.validation "
            f"take where they set none, not {type(default).__name__}"
        )
    known = set().union(*entry_keys.values())
    unknown = sorted(str(key) for key in default if key not in known)
    if unknown:
        raise ValueError(
            f"data.default.{unknown[0]}: unknown key (a data set entry's keys: "
            f"{', '.join(sorted(known))})"
        )
    for name, accepted in entry_keys.items():
        entry = out.get(name)
        if isinstance(entry, Mapping):
            filled = {k: v for k, v in default.items() if k in accepted and k not in entry}
            out[name] = {**filled, **entry}
    return out

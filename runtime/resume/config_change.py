"""A resume never silently changes the computation: the config is compared with the
checkpoint's before Ray starts.

Every checkpoint holds the config it was trained with (``config.yaml``) and the content
identities of the paths in it (``input_identities`` in training_info.json). A resume
compares the keys `config_keys.KEY_KINDS` marks as deciding a step:

- a changed ``shape`` key is refused: the checkpoint's weights do not fit another model;
- a changed ``compute`` or ``optimizer`` key is refused unless the user allows it
  (``--allow-config-change``, or ``checkpointing.allow_config_change: true`` for embedding
  code); after a divergence (an attempt since the checkpoint's stopped ``diverged``) the
  ``optimizer`` keys may change without it, so a smaller lr resumes with the same command;
- whatever is accepted is recorded in ``run_started`` (`ConfigRecord`), with the digest of
  the keys that decide a step, so the log says which attempts computed alike.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sft_runtime.runtime.checkpoint.save import IDENTITIES_INFO_KEY
from sft_runtime.runtime.config import MasterConfig, _model_of
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.resume.config_keys import (
    BEFORE_THE_KEY,
    IDENTITY_KEYS,
    KEY_KINDS,
    MISSING,
    OPTIMIZER,
    PLACEMENT,
    SHAPE,
    Kind,
    computation_keys,
    config_leaves,
    flatten,
)
from sft_runtime.runtime.resume.input_identity import input_identities
from sft_runtime.runtime.resume.placement_change import SHARDS_KEY, check_placement, saved_shards

ALLOW_FLAG = "--allow-config-change"
ALLOW_KEY = "checkpointing.allow_config_change"


@dataclass(frozen=True)
class ConfigRecord:
    """What ``run_started`` says about an attempt's config: the digest of the keys that
    decide a step, the identities of its inputs, the computation keys changed since the
    checkpoint it resumed from (key -> [old, new]) and whether AdamW's state was restored
    (None on a fresh start)."""

    digest: str
    identities: dict[str, str]
    changes: dict[str, list[Any]] = field(default_factory=dict)
    optimizer_restored: bool | None = None


@dataclass(frozen=True)
class Change:
    key: str
    kind: Kind
    old: Any
    new: Any

    def describe(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


def config_record(config: MasterConfig) -> ConfigRecord:
    """The record of a fresh start (or of a config nobody compared)."""
    flat = _flat(config)
    identities = input_identities(flat)
    return ConfigRecord(config_digest(flat, identities), identities)


def config_digest(flat: dict[str, Any], identities: dict[str, str]) -> str:
    """``sha256:`` of the keys that decide a step, paths by their content: two attempts with
    one digest compute alike whatever else (budget, logging, where) differs."""
    parts = {key: identities.get(key, flat.get(key)) for key in computation_keys()}
    if parts.get(SHARDS_KEY) == saved_shards({**flat, SHARDS_KEY: None}):
        parts[SHARDS_KEY] = None  # one shard a worker: what a config without the key means
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def check_resume_config(
    config: MasterConfig,
    checkpoint: Path,
    *,
    diverged: bool = False,
    optimizer_restored: bool = True,
) -> ConfigRecord:
    """Compare ``config`` with the one checkpoint ``checkpoint`` (a ``step_N`` folder) was
    trained with; refuse (`UserInputError`, one line) what may not change, else return the
    record of what did. ``diverged``: an attempt since that checkpoint stopped on a
    non-finite step."""
    allow = config.checkpointing.allow_config_change
    new_flat = _flat(config)
    new_ids = input_identities(new_flat)
    record = ConfigRecord(
        config_digest(new_flat, new_ids), new_ids, optimizer_restored=optimizer_restored
    )
    saved = _saved_config(checkpoint)
    if saved is None:
        if allow:
            return record
        raise UserInputError(
            f"{checkpoint / 'config.yaml'}: missing, so the resume cannot be compared with the "
            f"config the checkpoint was trained with; pass {ALLOW_FLAG} to resume anyway"
        )
    old_flat = flatten(saved, config_leaves())
    check_placement(checkpoint, old_flat, new_flat)
    old_ids = _saved_identities(checkpoint, old_flat)
    changes = config_changes(old_flat, old_ids, new_flat, new_ids)
    shape = [c for c in changes if c.kind == SHAPE]
    if shape:
        raise UserInputError(
            f"{checkpoint}: the model changed since this checkpoint ({_listed(shape)}); its "
            "weights cannot be loaded into another model, whatever "
            f"{ALLOW_FLAG} says: resume with the checkpoint's values, or export it "
            "(`sft-runtime export`) and start a new run directory from the export"
        )
    # the workers may change within the shards (checked above); the samples stay the same
    needs_flag = [
        c for c in changes if c.kind != PLACEMENT and not (diverged and c.kind == OPTIMIZER)
    ]
    if needs_flag and not allow:
        after = (
            " (after the divergence only the optimizer's, the schedule's and "
            "policy.max_grad_norm may change without it)"
            if diverged
            else ""
        )
        raise UserInputError(
            f"{checkpoint}: resuming with this config would change what the steps compute "
            f"({_listed(needs_flag)}); resume with the checkpoint's values, or pass "
            f"{ALLOW_FLAG} ({ALLOW_KEY}=true) to train on with the change recorded in "
            f"run_started{after}"
        )
    return ConfigRecord(
        record.digest,
        new_ids,
        {c.key: [_plain(c.old), _plain(c.new)] for c in changes},
        optimizer_restored,
    )


def config_changes(
    old_flat: dict[str, Any],
    old_ids: dict[str, str],
    new_flat: dict[str, Any],
    new_ids: dict[str, str],
) -> list[Change]:
    """The computation keys whose value (for a path: whose content) differs, in table order.
    A key an older release's config lacks counts as that key's default."""
    out = []
    for key in computation_keys():
        old, new = old_flat.get(key, MISSING), new_flat.get(key)
        if old == MISSING:
            old = _default(key)
        if key in IDENTITY_KEYS:
            if _same_input(old, new, old_ids.get(key), new_ids.get(key)):
                continue
            old, new = _with_identity(old, old_ids.get(key)), _with_identity(new, new_ids.get(key))
        elif isinstance(old, dict) and isinstance(new, dict):  # optimizer kwargs
            for sub in sorted(old.keys() | new.keys()):
                was, now = old.get(sub, MISSING), new.get(sub, MISSING)
                if _plain(was) != _plain(now):
                    out.append(Change(f"{key}.{sub}", KEY_KINDS[key], was, now))
            continue
        elif _plain(old) == _plain(new):
            continue
        out.append(Change(key, KEY_KINDS[key], old, new))
    return out


def _same_input(old: Any, new: Any, old_id: str | None, new_id: str | None) -> bool:
    """The same content, wherever it lies; the same path counts as the same input only
    when no identity says otherwise (a checkpoint of an older release records none)."""
    if old_id is not None and new_id is not None:
        return old_id == new_id
    return old == new


def _with_identity(path: Any, identity: str | None) -> Any:
    if path is None or identity is None:
        return path
    return f"{path} ({identity[:15]})"


def _saved_config(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise UserInputError(f"{path}: not a config (a mapping of sections)")
    return data


def _saved_identities(checkpoint: Path, old_flat: dict[str, Any]) -> dict[str, str]:
    """The identities the checkpoint recorded; for a checkpoint without them, those of its
    paths as they are now (when they still exist)."""
    try:
        info = json.loads((checkpoint / "training_info.json").read_text())
        recorded = info.get(IDENTITIES_INFO_KEY)
    except (OSError, ValueError, AttributeError):
        recorded = None
    if isinstance(recorded, dict):
        return {k: v for k, v in recorded.items() if isinstance(v, str)}
    return input_identities(old_flat)


def _flat(config: MasterConfig) -> dict[str, Any]:
    return flatten(config.model_dump(mode="json"), config_leaves())


def _default(key: str) -> Any:
    """What a key an older config lacks meant: the value runs had before the key existed
    where today's default differs (`BEFORE_THE_KEY`), else the default (`MISSING` for a
    required one)."""
    if key in BEFORE_THE_KEY:
        return BEFORE_THE_KEY[key]

    model: Any = MasterConfig
    *sections, name = key.split(".")
    for part in sections:
        model = _model_of(model.model_fields[part].annotation)
    info = model.model_fields[name]
    if info.is_required():
        return MISSING
    return _plain(info.get_default(call_default_factory=True))


def _plain(value: Any) -> Any:
    """Tuples as lists, as a YAML round trip gives them."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _show(value: Any) -> str:
    return json.dumps(_plain(value), default=str)


def _listed(changes: list[Change]) -> str:
    return "; ".join(c.describe() for c in changes)


def resume_config(config: MasterConfig, run_dir: Path, resume: Any) -> ConfigRecord:
    """The record of the attempt about to start from ``resume`` (a `ResumePoint`), after
    `check_resume_config` refused what may not change."""
    if not resume.step:
        return config_record(config)
    checkpoint = resume.policy_dir.parent
    try:
        writer = json.loads((checkpoint / "training_info.json").read_text()).get("attempt")
    except (OSError, ValueError, AttributeError):
        writer = None
    return check_resume_config(
        config,
        checkpoint,
        diverged=diverged_since(run_dir, writer if isinstance(writer, int) else 0),
        optimizer_restored=(resume.policy_dir / "optimizer").is_dir(),
    )


def diverged_since(run_dir: Path, attempt: int) -> bool:
    """Whether attempt ``attempt`` (the one that wrote the checkpoint) or a later one stopped
    because a step diverged."""
    from sft_runtime.events import history, read_log
    from sft_runtime.events.log import log_path

    path = log_path(run_dir)
    if not path.is_file():
        return False
    attempts = history(read_log(path)).attempts
    return any(a.number >= attempt and a.stop_reason == "diverged" for a in attempts)


def resume_notes(record: ConfigRecord, step: int) -> list[str]:
    """What the user is told before an attempt that does not continue the checkpoint's run
    bit for bit: the changes it trains with, and an optimizer that starts fresh."""
    notes = []
    if record.changes:
        shown = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in record.changes.items())
        notes.append(
            f"resuming from step {step} with a changed config (recorded in run_started): {shown}"
        )
    if record.optimizer_restored is False:
        notes.append(
            f"checkpoint step_{step} holds no optimizer state (checkpointing.save_optimizer="
            "false): AdamW starts fresh, so this resume does not continue the run bit for bit"
        )
    return notes

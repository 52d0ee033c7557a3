"""Event payloads: small frozen facts in the past tense, one model per record type; and the
line each is written as (`Record`, `encode`, at the end), which the log and its scan share.

Each payload carries a ``schema_version``. Readers upgrade older payloads in one place
(`upcast`) and refuse newer ones, so a log written by a later release is reported rather
than half-understood.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def as_float(value: Any) -> float:
    """A stored measurement as a float. A non-finite value is stored as the string ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"`` (JSON has no literal for it); logs written before that
    hold ``null`` there, which reads as NaN, so every log ever written stays readable."""
    return math.nan if value is None else float(value)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float spelled as a string (see `as_float`): orjson
    would write ``null``, which says "absent", not "diverged"."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


#: A measured number (a loss, a norm, a rate, seconds): finite, or NaN/inf when a step
#: diverged; ``null`` in an older log reads as NaN.
Measured = Annotated[float, BeforeValidator(lambda v: math.nan if v is None else v)]


class EventPayload(BaseModel):
    """Base of every payload: frozen, no unknown fields, plain values only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_type: ClassVar[str] = ""
    schema_version: int = 1


class RunStarted(EventPayload):
    """An attempt began: fresh (``resumed_from_step`` None) or from checkpoint K."""

    event_type: ClassVar[str] = "run_started"
    schema_version: int = 2
    placement_hash: str
    resumed_from_step: int | None = None
    max_steps: int | None = None
    logical_world_size: int | None = None
    # sha256 of the config keys that decide a step (runtime/resume/config_keys.py):
    # attempts with one digest compute alike
    config_digest: str | None = None
    # key -> [old, new] of those keys changed since the checkpoint resumed from (allowed by
    # the user, or an optimizer key after a divergence); None: not compared (version 1)
    config_changes: dict[str, list[Any]] | None = None
    # a resume found AdamW's state in the checkpoint (False: it started fresh); None: a
    # fresh start, or not recorded (version 1)
    optimizer_restored: bool | None = None
    node_ids: list[str] = Field(default_factory=list)
    host: str | None = None
    pid: int | None = None


class LoadersReady(EventPayload):
    """Every loader owner built its energon loader (restored or fresh)."""

    event_type: ClassVar[str] = "loaders_ready"
    owner_ranks: list[int]
    logical_world_size: int
    restored: bool
    seconds: float = 0.0


class PlacementChanged(EventPayload):
    """A resume trains on another number of data-parallel workers than the checkpoint's run:
    the same data shards (each with its own sample stream), dealt anew."""

    event_type: ClassVar[str] = "placement_changed"
    resumed_from_step: int = Field(ge=1)
    old_world_size: int = Field(ge=1)
    new_world_size: int = Field(ge=1)
    shards: int = Field(ge=1)
    # the shards each worker loads, in rank order
    shard_map: list[list[int]]


class StepCommitted(EventPayload):
    """An optimizer step finished on every worker and every owner committed its batch."""

    event_type: ClassVar[str] = "step_committed"
    schema_version: int = 2
    step: int = Field(ge=1)
    source_samples: int = Field(ge=0)
    valid_tokens: int = Field(ge=0)
    physical_packs: int = Field(ge=0)
    # samples over the length limit (cut or dropped) and samples the chat template refused
    overlong_samples: int = Field(0, ge=0)
    skipped_samples: int = Field(0, ge=0)
    loss: Measured
    grad_norm: Measured
    lr: Measured
    timings: dict[str, Measured] = Field(default_factory=dict)
    sample_digests: list[str] = Field(default_factory=list)
    trace_id: str | None = None
    span_id: str | None = None


class StepAborted(EventPayload):
    """A step failed: the policy step was dropped and the loader batches rewound."""

    event_type: ClassVar[str] = "step_aborted"
    step: int = Field(ge=1)
    phase: str
    error_type: str
    error: str
    trace_id: str | None = None
    span_id: str | None = None


class CheckpointSaved(EventPayload):
    """``checkpoints/step_<step>`` is complete and renamed into place."""

    event_type: ClassVar[str] = "checkpoint_saved"
    step: int = Field(ge=0)
    path: str
    total_steps: int
    consumed_samples: int
    total_valid_tokens: int
    metric: float | None = None  # null: no metric (or a non-finite one)
    seconds: float = 0.0


class ValidationCompleted(EventPayload):
    """A validation pass ran on the weights after step ``step`` (0: before the first)."""

    event_type: ClassVar[str] = "validation_completed"
    step: int = Field(ge=0)
    loss: Measured
    tokens: int = Field(ge=0)
    samples: int = Field(ge=0)
    sample_digest: str
    seconds: float = 0.0
    trace_id: str | None = None
    span_id: str | None = None


class RunStopped(EventPayload):
    """The attempt ended, and why."""

    event_type: ClassVar[str] = "run_stopped"
    schema_version: int = 2
    # diverged: a step's loss or gradient norm was not finite, and its update was not applied
    reason: Literal["completed", "budget_reached", "interrupted", "failed", "timeout", "diverged"]
    last_step: int = Field(ge=0)
    error: str | None = None


class LogRepaired(EventPayload):
    """A torn last line (a crash mid-write) was cut off when the log was reopened."""

    event_type: ClassVar[str] = "log_repaired"
    dropped_bytes: int = Field(ge=1)
    at_line: int = Field(ge=1)
    reason: str


EVENT_TYPES: dict[str, type[EventPayload]] = {
    cls.event_type: cls
    for cls in (
        RunStarted,
        LoadersReady,
        PlacementChanged,
        StepCommitted,
        StepAborted,
        CheckpointSaved,
        ValidationCompleted,
        RunStopped,
        LogRepaired,
    )
}

# type -> current schema version, read once (the scan loop checks it for every line)
VERSIONS: dict[str, int] = {
    t: c.model_fields["schema_version"].default for t, c in EVENT_TYPES.items()
}

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
# (event type, version it reads) -> function returning the data at version + 1.
UPCASTERS: dict[tuple[str, int], Upcaster] = {
    # version 1 had no sample counts: it cut overlong samples silently and never skipped one
    ("step_committed", 1): lambda d: {
        **d,
        "overlong_samples": 0,
        "skipped_samples": 0,
        "schema_version": 2,
    },
    # version 2 added the reason "diverged"; a version 1 record never has it
    ("run_stopped", 1): lambda d: {**d, "schema_version": 2},
    # version 1 compared no config on resume and did not say whether AdamW was restored
    ("run_started", 1): lambda d: {
        **d,
        "config_changes": None,
        "optimizer_restored": None,
        "schema_version": 2,
    },
}


def current_version(type_: str) -> int:
    return VERSIONS[type_]


def upcast(type_: str, data: dict[str, Any]) -> dict[str, Any]:
    """Bring a stored payload up to the current schema version of its type.

    Raises KeyError for an unknown type and ValueError for a version newer than this
    release knows, or an old version with no upgrade path.
    """
    target = current_version(type_)
    version = data.get("schema_version", 1)
    if not isinstance(version, int) or version > target:
        raise ValueError(
            f"{type_} schema_version {version!r} is newer than this release reads ({target})"
        )
    while version < target:
        step = UPCASTERS.get((type_, version))
        if step is None:
            raise ValueError(f"no upgrade of {type_} from schema_version {version}")
        data = step(dict(data))
        version = data["schema_version"]
    return data


def parse_payload(type_: str, data: dict[str, Any]) -> EventPayload:
    """Validate stored data as its payload model (after upcasting)."""
    return EVENT_TYPES[type_].model_validate(upcast(type_, data))


# ---------------------------------------------------------------------- one line of the log
# One line of the log, and the canonical bytes and digest that chain the lines together.
#
# A line is the record's JSON with sorted keys and no spaces, with the ``digest`` field
# spliced in last. The digest is SHA-256 over the line as it would read without that field,
# so a reader (`events.scan`) checks it on the bytes it read, without re-encoding anything:
# that keeps verification cheap enough to run on every open.


GENESIS = "0" * 64
_DIGEST_PREFIX = b',"digest":"'
_SUFFIX_LEN = len(_DIGEST_PREFIX) + 64 + 2  # ,"digest":"<64 hex>"}


class Record(NamedTuple):
    """A verified record as read back: envelope fields plus the payload as plain data.

    A named tuple: immutable like a frozen dataclass, but built about 5x faster, and one is
    built per line of every replay.
    """

    seq: int
    type: str
    time: float
    attempt: int
    data: dict[str, Any]
    prev: str
    digest: str
    line: int = 0  # 1-based line number in the file it came from (0 when not from a file)


def encode(
    seq: int, type_: str, time: float, attempt: int, data: dict[str, Any], prev: str
) -> tuple[bytes, str]:
    """Return (line without newline, digest) for a new record."""
    body = orjson.dumps(
        {"attempt": attempt, "data": data, "prev": prev, "seq": seq, "time": time, "type": type_},
        option=orjson.OPT_SORT_KEYS,
    )
    digest = hashlib.sha256(body).hexdigest()
    return body[:-1] + _DIGEST_PREFIX + digest.encode() + b'"}', digest

"""Which records are in effect, what each attempt did, and whether re-runs matched.

A resume from checkpoint K starts a new attempt whose `run_started` says
``resumed_from_step: K``; every step the earlier attempts committed after K is rolled back.
A record of attempt a about step s therefore stays in effect only while s is at most the
smallest resume point of every later attempt. Two streaming passes find this: the first
reads only the resume points, the second filters. A fold that only needs the end can take
`records_in_time` instead, one pass. Nothing here knows the save state; the fold lives in
`states/`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sft_runtime.events.errors import LineageError
from sft_runtime.events.log import EventLog, LogReader, read_log
from sft_runtime.events.schemas import Record

LogLike = str | Path | EventLog | LogReader | Iterable[Record]
_STEP_TYPES = ("step_committed", "checkpoint_saved", "validation_completed")


def _source(log: LogLike) -> Iterable[Record]:
    """Something that can be iterated more than once."""
    if isinstance(log, str | Path):
        return read_log(log)
    if isinstance(log, EventLog):
        return _Rereadable(log)
    if isinstance(log, list | tuple | LogReader | _Rereadable):
        return log
    return list(log)


class _Rereadable:
    def __init__(self, log: EventLog) -> None:
        self.log = log

    def __iter__(self) -> Iterator[Record]:
        return self.log.records()


def _origin(log: LogLike, records: Iterable[Record]) -> str:
    return str(getattr(records, "path", log if isinstance(log, str | Path) else "<records>"))


def resume_limits(records: Iterable[Record]) -> dict[int, float]:
    """attempt -> the highest step of that attempt still in effect (inf when none rolled back)."""
    if isinstance(records, LogReader):
        resumes = records.resume_points()
    else:
        resumes = [
            (rec.attempt, rec.data.get("resumed_from_step") or 0)
            for rec in records
            if rec.type == "run_started"
        ]
    limits: dict[int, float] = {}
    floor = math.inf
    for attempt, resumed in reversed(resumes):
        limits[attempt] = floor
        floor = min(floor, resumed)
    return limits


def records_in_effect(log: LogLike) -> Iterator[Record]:
    """Stream the records that still count, checking that the story they tell is possible.

    The check follows time, not the final view (see `records_in_time`). Raises
    `LineageError` (with the line) when the story is impossible.
    """
    source = _source(log)
    limits = resume_limits(source)
    records = records_in_time(source, _origin(log, source))
    if all(limit == math.inf for limit in limits.values()):
        yield from records  # nothing was rolled back
        return
    for rec in records:
        if rec.type in _STEP_TYPES and rec.data["step"] > limits.get(rec.attempt, math.inf):
            continue
        yield rec


def records_in_time(log: LogLike, origin: str | None = None) -> Iterator[Record]:
    """Every record in the order written, rolled back or not, checked as time goes.

    Each step must follow the previous one of the live lineage; a resume must start from a
    checkpoint that was in effect then; a checkpoint or a validation is of the last step.
    A fold that rewinds at each resume to the checkpoint it starts from ends where the
    fold of `records_in_effect` ends, in one pass. Raises `LineageError` (with the line).
    """
    source = _source(log)
    origin = _origin(log, source) if origin is None else origin
    last_step = 0
    checkpoints = {0}
    for rec in source:
        type_ = rec.type
        if type_ == "step_committed":  # nearly every line: checked first
            step = rec.data["step"]
            if step != last_step + 1:
                raise LineageError(
                    origin,
                    rec.line,
                    f"step {step} committed after step {last_step} (steps must follow one another)",
                )
            last_step = step
        elif type_ == "run_started":
            resumed = rec.data.get("resumed_from_step") or 0
            if resumed not in checkpoints:
                raise LineageError(
                    origin,
                    rec.line,
                    f"attempt {rec.attempt} resumes from step {resumed}, "
                    "but no checkpoint_saved in effect covers that step",
                )
            last_step = resumed
            checkpoints = {s for s in checkpoints if s <= resumed}
        elif type_ == "checkpoint_saved":
            if rec.data["step"] != last_step:
                raise LineageError(
                    origin,
                    rec.line,
                    f"checkpoint of step {rec.data['step']} saved after step {last_step}",
                )
            checkpoints.add(last_step)
        elif type_ == "validation_completed" and rec.data["step"] != last_step:
            raise LineageError(
                origin,
                rec.line,
                f"validation of step {rec.data['step']} completed after step {last_step}",
            )
        yield rec


@dataclass
class Attempt:
    """What one launch of the run did, as the log tells it."""

    number: int
    resumed_from_step: int | None = None
    started: float | None = None
    ended: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0
    rolled_back: int = 0
    aborts: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    validations: list[int] = field(default_factory=list)  # steps whose weights it validated
    repaired_bytes: int = 0
    stop_reason: str | None = None
    stop_error: str | None = None
    # from its run_started: the digest of the keys that decide a step, those keys changed
    # since the checkpoint it resumed from (key -> [old, new]), and whether AdamW's state
    # was restored (False: it started fresh)
    config_digest: str | None = None
    config_changes: dict[str, list[Any]] = field(default_factory=dict)
    optimizer_restored: bool | None = None
    # from its placement_changed: it trained on another number of workers than the run it
    # resumed ((old, new) data-parallel workers), and the data shards each of them loaded
    workers_changed: tuple[int, int] | None = None
    shard_map: list[list[int]] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        return self.stop_reason or "no run_stopped (crashed, killed or running)"


@dataclass
class History:
    attempts: list[Attempt]
    records: int
    last_seq: int | None


def history(log: LogLike) -> History:
    """The attempts of a run with their steps, aborts, checkpoints and how each ended."""
    source = _source(log)
    limits = resume_limits(source)
    attempts: dict[int, Attempt] = {}
    count, last_seq = 0, None
    for rec in source:
        count, last_seq = count + 1, rec.seq
        att = attempts.get(rec.attempt)
        if att is None:
            att = attempts[rec.attempt] = Attempt(rec.attempt, started=rec.time)
        att.ended = rec.time
        data = rec.data
        if rec.type == "run_started":
            att.resumed_from_step = data.get("resumed_from_step")
            att.config_digest = data.get("config_digest")
            att.config_changes = dict(data.get("config_changes") or {})
            att.optimizer_restored = data.get("optimizer_restored")
        elif rec.type == "placement_changed":
            att.workers_changed = (data["old_world_size"], data["new_world_size"])
            att.shard_map = data["shard_map"]
        elif rec.type == "step_committed":
            att.steps += 1
            att.first_step = data["step"] if att.first_step is None else att.first_step
            att.last_step = data["step"]
            att.rolled_back += data["step"] > limits.get(rec.attempt, math.inf)
        elif rec.type == "step_aborted":
            att.aborts.append({k: data[k] for k in ("step", "phase", "error_type", "error")})
        elif rec.type == "checkpoint_saved":
            att.checkpoints.append(data["step"])
        elif rec.type == "validation_completed":
            att.validations.append(data["step"])
        elif rec.type == "run_stopped":
            att.stop_reason, att.stop_error = data["reason"], data.get("error")
        elif rec.type == "log_repaired":
            att.repaired_bytes += data["dropped_bytes"]
    return History(sorted(attempts.values(), key=lambda a: a.number), count, last_seq)


@dataclass(frozen=True)
class Divergence:
    """The first re-executed step whose samples or loss differ from its first execution."""

    step: int
    first_attempt: int
    later_attempt: int
    field: str  # "sample_digests" or "loss"; of a validation "val_samples" or "val_loss"
    first_value: Any
    later_value: Any
    ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        where = f" (logical ranks {list(self.ranks)})" if self.ranks else ""
        return (
            f"step {self.step}: {self.field} differ{where} between attempt "
            f"{self.first_attempt} ({self.first_value}) and attempt {self.later_attempt} "
            f"({self.later_value})"
        )


def compare_reexecutions(log: LogLike) -> tuple[int, list[Divergence]]:
    """(number of re-executions compared, every divergence found, in step order).

    Two executions are compared only when their attempts computed alike: a run_started
    ``config_digest`` that differs says the user changed a key that decides a step (the
    change is recorded there), and ``optimizer_restored: false`` that AdamW started fresh,
    so their steps are not expected to match.
    """
    source = _source(log)
    limits = resume_limits(source)
    first_runs: dict[tuple[str, int], Record] = {}
    digests: dict[int, str | None] = {}
    compared, found = 0, []
    for rec in source:
        if rec.type == "run_started":
            digests[rec.attempt] = rec.data.get("config_digest")
            if rec.data.get("optimizer_restored") is False:
                digests[rec.attempt] = f"{digests[rec.attempt]}, AdamW started fresh"
        if rec.type not in _COMPARED:
            continue
        step = rec.data["step"]
        earlier = first_runs.get((rec.type, step))
        if earlier is not None and _other_config(digests, earlier.attempt, rec.attempt):
            if step > limits.get(rec.attempt, math.inf):
                first_runs[rec.type, step] = rec  # a later attempt may run it alike
        elif earlier is not None:
            compared += 1
            diff = _differ(earlier, rec)
            if diff is not None:
                found.append(diff)
        elif step > limits.get(rec.attempt, math.inf):
            first_runs[rec.type, step] = rec  # rolled back: a later attempt runs it again
    return compared, sorted(found, key=lambda d: d.step)


def _other_config(digests: dict[int, str | None], first: int, later: int) -> bool:
    a, b = digests.get(first), digests.get(later)
    return a is not None and b is not None and a != b


def divergence(log: LogLike) -> Divergence | None:
    """The first re-executed step that did not reproduce exactly, or None."""
    found = compare_reexecutions(log)[1]
    return found[0] if found else None


_COMPARED = ("step_committed", "validation_completed")


def _differ(first: Record, later: Record) -> Divergence | None:
    if first.type == "validation_completed":
        for key, name in (("sample_digest", "val_samples"), ("loss", "val_loss")):
            if first.data[key] != later.data[key]:
                return Divergence(
                    first.data["step"],
                    first.attempt,
                    later.attempt,
                    name,
                    first.data[key],
                    later.data[key],
                )
        return None
    a, b = first.data.get("sample_digests", []), later.data.get("sample_digests", [])
    if a != b:
        ranks = tuple(i for i in range(max(len(a), len(b))) if a[i : i + 1] != b[i : i + 1])
        return Divergence(
            first.data["step"], first.attempt, later.attempt, "sample_digests", a, b, ranks
        )
    if first.data["loss"] != later.data["loss"]:
        return Divergence(
            first.data["step"],
            first.attempt,
            later.attempt,
            "loss",
            first.data["loss"],
            later.data["loss"],
        )
    return None

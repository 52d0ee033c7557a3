"""`SFTV2SaveState` and the pure fold that rebuilds it from the log.

The save state is what a resume must agree on: how many optimizer steps are done, how many
source samples and supervised tokens they consumed, and the placement the loaders were
sharded for. It changes only when a step commits, so it always sits on an optimizer-step
boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sft_runtime.events.errors import LineageError
from sft_runtime.events.lineage import LogLike, records_in_effect
from sft_runtime.events.record import Record


@dataclass(frozen=True, slots=True)
class SFTV2SaveState:
    """Training progress at an optimizer-step boundary."""

    total_steps: int = 0
    consumed_samples: int = 0
    total_valid_tokens: int = 0
    placement_hash: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SFTV2SaveState:
        missing = [
            k for k in ("total_steps", "consumed_samples", "total_valid_tokens") if k not in data
        ]
        if missing:
            raise ValueError(f"save state is missing {', '.join(missing)}")
        return cls(
            total_steps=int(data["total_steps"]),
            consumed_samples=int(data["consumed_samples"]),
            total_valid_tokens=int(data["total_valid_tokens"]),
            placement_hash=str(data.get("placement_hash", "")),
        )


def initial_save_state(placement_hash: str = "") -> SFTV2SaveState:
    return SFTV2SaveState(placement_hash=placement_hash)


# One handler per event type that moves the save state: (state, payload data) -> state.
# `apply`, `replay` and the controller's machine all fold through these.
def run_started(state: SFTV2SaveState, data: dict[str, Any]) -> SFTV2SaveState:
    return SFTV2SaveState(
        state.total_steps, state.consumed_samples, state.total_valid_tokens, data["placement_hash"]
    )


def next_counters(counters: tuple[int, int, int], data: dict[str, Any]) -> tuple[int, int, int]:
    """(steps, samples, tokens) after one ``step_committed``: the step-order rule lives here
    alone (a step follows the last one, nothing is skipped or repeated)."""
    steps, samples, tokens = counters
    step = data["step"]
    if step != steps + 1:
        raise ValueError(f"step {step} cannot follow total_steps {steps}")
    return step, samples + data["source_samples"], tokens + data["valid_tokens"]


def step_committed(state: SFTV2SaveState, data: dict[str, Any]) -> SFTV2SaveState:
    counters = (state.total_steps, state.consumed_samples, state.total_valid_tokens)
    return SFTV2SaveState(*next_counters(counters, data), state.placement_hash)


def checkpoint_saved(state: SFTV2SaveState, data: dict[str, Any]) -> SFTV2SaveState:
    saved = (data["total_steps"], data["consumed_samples"], data["total_valid_tokens"])
    folded = (state.total_steps, state.consumed_samples, state.total_valid_tokens)
    if saved != folded:
        raise ValueError(
            f"checkpoint of step {data['step']} records (steps, samples, tokens) = {saved} "
            f"but the log folds to {folded}"
        )
    return state


HANDLERS: dict[str, Callable[[SFTV2SaveState, dict[str, Any]], SFTV2SaveState]] = {
    "run_started": run_started,
    "step_committed": step_committed,
    "checkpoint_saved": checkpoint_saved,
}


def apply(state: SFTV2SaveState, record: Record) -> SFTV2SaveState:
    """Fold one record into the save state; types that do not move it leave it as is."""
    handler = HANDLERS.get(record.type)
    return state if handler is None else handler(state, record.data)


def replay(log: LogLike, until_step: int | None = None) -> SFTV2SaveState:
    """The save state after the records in effect, stopping after step ``until_step``.

    The same fold as `apply` over `records_in_effect` (a property test holds them equal):
    ``step_committed``, nearly every line of a log and the cost of every resume, keeps its
    counters as plain integers between records (`next_counters`, the handler's own rule)
    instead of building a save state per line; every other type goes through `HANDLERS`.
    Raises `events.LineageError` (naming the line) when a record cannot be folded.
    """
    placement = ""
    counters = (0, 0, 0)
    stop = math.inf if until_step is None else until_step
    rec = None
    try:
        for rec in records_in_effect(log):
            if rec.type == "step_committed":
                if rec.data["step"] > stop:
                    break
                counters = next_counters(counters, rec.data)
            elif rec.type in HANDLERS:
                state = HANDLERS[rec.type](SFTV2SaveState(*counters, placement), rec.data)
                placement = state.placement_hash
    except ValueError as exc:
        if rec is None:
            raise
        raise LineageError(getattr(log, "path", str(log)), rec.line, str(exc)) from None
    if until_step is not None and counters[0] < until_step:
        raise ValueError(f"the log ends at step {counters[0]}, before step {until_step}")
    return SFTV2SaveState(*counters, placement)

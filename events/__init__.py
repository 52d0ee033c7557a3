"""The append-only event log: schemas, canonical bytes and digests, the JSONL log, lineage.

Nothing here imports ray or torch: a log can be read, verified and replayed on a laptop.
"""

from sft_runtime.events.errors import EventLogCorrupted, EventLogError, EventLogLocked, LineageError
from sft_runtime.events.lineage import (
    Attempt,
    Divergence,
    History,
    compare_reexecutions,
    divergence,
    history,
    records_in_effect,
)
from sft_runtime.events.log import EventLog, open_log, read_log
from sft_runtime.events.schemas import (
    EVENT_TYPES,
    CheckpointSaved,
    EventPayload,
    LoadersReady,
    LogRepaired,
    PlacementChanged,
    Record,
    RunStarted,
    RunStopped,
    StepAborted,
    StepCommitted,
)

__all__ = [
    "EVENT_TYPES",
    "Attempt",
    "CheckpointSaved",
    "Divergence",
    "EventLog",
    "EventLogCorrupted",
    "EventLogError",
    "EventLogLocked",
    "EventPayload",
    "History",
    "LineageError",
    "LoadersReady",
    "LogRepaired",
    "PlacementChanged",
    "Record",
    "RunStarted",
    "RunStopped",
    "StepAborted",
    "StepCommitted",
    "compare_reexecutions",
    "divergence",
    "history",
    "open_log",
    "read_log",
    "records_in_effect",
]

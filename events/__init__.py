"""The append-only event log: schemas, canonical bytes and digests, the JSONL log, lineage.

Nothing here imports ray or torch: a log can be read, verified and replayed on a laptop.
"""

from events.errors import EventLogCorrupted, EventLogError, EventLogLocked, LineageError
from events.lineage import (
    Attempt,
    Divergence,
    History,
    compare_reexecutions,
    divergence,
    history,
    records_in_effect,
)
from events.log import EventLog, open_log, read_log
from events.record import Record
from events.schemas import (
    EVENT_TYPES,
    CheckpointSaved,
    EventPayload,
    LoadersReady,
    LogRepaired,
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

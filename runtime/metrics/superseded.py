"""metrics.jsonl on a resume: the rows of the steps the resume executes again are dropped.

A resume from checkpoint K executes steps K+1 onwards again; the rows earlier attempts
wrote for them are superseded. Left in place, a plot by step (what a TensorBoard or W&B
user reads) shows two values for one step. So before the new attempt writes anything, the
file keeps only the rows of steps up to K, as the TensorBoard writer's ``purge_step`` does
for its event files and the log's lineage does for its records; the superseded values stay
provable in ``events.jsonl``, where `verify` compares each re-executed step with its first
execution. The file is rewritten beside itself, fsynced and renamed over the old one, so a
crash leaves either the old rows or the kept ones, never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from sft_runtime.events.log import fsync_dir

METRICS_NAME = "metrics.jsonl"


def drop_superseded_rows(log_dir: Path | str, resume_step: int) -> int:
    """Keep the rows of ``<log_dir>/metrics.jsonl`` whose step is at most ``resume_step``
    (the step the attempt resumes from; 0 for a fresh start); returns how many were dropped.
    A line that is not a whole row (the torn end of a killed attempt) goes with them."""
    path = Path(log_dir) / METRICS_NAME
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = [line for line in lines if _kept(line, resume_step)]
    if len(kept) == len(lines):
        return 0  # nothing to drop: the file stays as it is
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.writelines(kept)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return len(lines) - len(kept)


def _kept(line: bytes, resume_step: int) -> bool:
    if not line.endswith(b"\n"):
        return False  # torn
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    step = row.get("step") if isinstance(row, dict) else None
    return not isinstance(step, int) or step <= resume_step

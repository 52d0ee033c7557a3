"""The TensorBoard backend (``logger.tensorboard_enabled``): event files under the run.

The controller logs the metrics, and it trains nothing: torch's ``SummaryWriter`` would
import torch into it (about 2 s of CPU and 200 MiB at every start, for a few scalars a
step). So the event file is written here, from TensorBoard's own record types (its protobuf
messages, which import neither torch nor numpy) framed as TensorBoard reads them: each
record is its length, a checksum of the length, the bytes and a checksum of the bytes
(CRC-32C, masked). A record cut short by a crash is the last one and the reader drops it.

A resumed attempt writes a ``SessionLog.START`` at its first step, so TensorBoard hides
what earlier attempts wrote from there on: the steps the resume rolled back, as the event
log's lineage does.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_INSTALL = "pip install 'sft-runtime[tensorboard]'"
FILE_VERSION = "brain.Event:2"
# files of one second and one process sort in the order they were opened
_opened = itertools.count()


class TensorboardConfig(BaseModel):
    """NeMo RL's ``logger.tensorboard`` block: where the event files go, under the run."""

    model_config = ConfigDict(extra="forbid")

    log_dir: str = TENSORBOARD_DIR  # relative to the metrics' folder (the run directory)


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TensorBoard's records; a step's few hundred
    bytes take microseconds in Python."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One record of an event file, framed as TensorBoard's reader expects."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", _masked(crc32c(length)))
        + data
        + struct.pack("<I", _masked(crc32c(data)))
    )


class TensorboardWriter:
    """Scalars at global steps, one event a step; each step is flushed to the OS, so a
    reader (and a crash) sees every step logged."""

    def __init__(self, directory: Path, first_step: int, protos: Any) -> None:
        self._event, self._session_log, self._summary = protos
        directory.mkdir(parents=True, exist_ok=True)
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
            f".{os.getpid()}.{next(_opened)}"
        )
        self._fh = open(directory / name, "ab")  # noqa: SIM115 - closed by close()
        self._write(self._event(wall_time=time.time(), file_version=FILE_VERSION))
        if first_step > 1:  # a resume: what earlier attempts logged from here on is hidden
            start = self._session_log(status=self._session_log.START)
            self._write(self._event(wall_time=time.time(), step=first_step, session_log=start))
        self._fh.flush()

    def _write(self, event: Any) -> None:
        self._fh.write(record(event.SerializeToString()))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=t, simple_value=v) for t, v in scalars.items()]
        summary = self._summary(value=values)
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))
        self._fh.flush()

    def close(self, reason: str = "completed") -> None:
        """TensorBoard records no outcome: every ``reason`` closes the same way."""
        self._fh.close()


def open_tensorboard(directory: Path, first_step: int) -> TensorboardWriter | None:
    """The writer of one attempt, or None (with a warning) where tensorboard is missing:
    config validation refuses the key on the driver, but the process that logs may run on
    a node without the extra, and it still trains."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
    except ImportError:
        warnings.warn(
            f"logger.tensorboard_enabled is on but tensorboard is not installed here "
            f"({TENSORBOARD_INSTALL}); metrics go to metrics.jsonl only",
            stacklevel=3,
        )
        return None
    return TensorboardWriter(directory, first_step, (Event, SessionLog, Summary))

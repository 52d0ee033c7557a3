"""One line of the log, and the canonical bytes and digest that chain the lines together.

A line is the record's JSON with sorted keys and no spaces, with the ``digest`` field
spliced in last. The digest is SHA-256 over the line as it would read without that field,
so a reader checks it on the bytes it read, without re-encoding anything: that keeps
verification cheap enough to run on every open.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

GENESIS = "0" * 64
_DIGEST_PREFIX = b',"digest":"'
_SUFFIX_LEN = len(_DIGEST_PREFIX) + 64 + 2  # ,"digest":"<64 hex>"}
_HEX = frozenset(b"0123456789abcdef")


@dataclass(frozen=True, slots=True)
class Record:
    """A verified record as read back: envelope fields plus the payload as plain data."""

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


def decode(raw: bytes) -> tuple[dict[str, Any], str]:
    """Parse one line (no newline) and check its own digest.

    Returns (fields, digest). Raises ValueError with a short reason when the line is not a
    well-formed record or its digest does not match its bytes.
    """
    if len(raw) <= _SUFFIX_LEN or raw[-_SUFFIX_LEN:-66] != _DIGEST_PREFIX or raw[-2:] != b'"}':
        raise ValueError("not a record line (no trailing digest field)")
    digest_bytes = raw[-66:-2]
    if not _HEX.issuperset(digest_bytes):
        raise ValueError("digest field is not 64 lowercase hex digits")
    try:
        fields = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ValueError("a record must be a JSON object")
    body = raw[:-_SUFFIX_LEN] + b"}"
    digest = digest_bytes.decode()
    if hashlib.sha256(body).hexdigest() != digest:
        raise ValueError("digest mismatch: the line was changed after it was written")
    return fields, digest

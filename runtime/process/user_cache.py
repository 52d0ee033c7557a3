"""The user's cache folder, shared by every checkout, run and test session on a machine."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sft-runtime``, else ``~/.cache/sft-runtime`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sft-runtime"

"""Multi-node tests reuse the controller tests' small config (tests/controller/small_run.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))

"""Runs a scenario of tests/traces/scenario.py in a fresh interpreter and returns its JSON.

Each scenario gets its own process because OpenTelemetry's global providers can be set
only once per process (and the pytest process itself stays free of any provider).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SCENARIO = Path(__file__).with_name("scenario.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(name: str, args: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), name, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def run_scenario() -> Callable[..., dict[str, Any]]:
    return _run


@pytest.fixture(scope="session")
def traced_run(tmp_path_factory) -> dict[str, Any]:
    """A run directory written by a 'controller' process and two 'worker' processes, merged."""
    run_dir = tmp_path_factory.mktemp("traced_run")
    return {"run_dir": run_dir, **_run("driver", {"run_dir": str(run_dir)}, timeout=120)}

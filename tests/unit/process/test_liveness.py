"""A controller can tell that its driver is gone (also while it is an unreaped zombie)."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from sft_runtime.runtime.process import liveness
from sft_runtime.runtime.process.liveness import (
    DriverGone,
    check_driver,
    driver_alive,
    driver_identity,
)


def test_alive_zombie_reaped_and_other_host():
    proc = subprocess.Popen(["sleep", "30"])
    info = {"driver_pid": proc.pid, "driver_host": socket.gethostname()}
    try:
        assert driver_alive(info) is True
        check_driver(info)
        if hasattr(os, "pidfd_open"):  # Linux: the checks poll a pidfd opened once
            assert liveness._watches[proc.pid] is not None
        proc.kill()
        deadline = time.monotonic() + 120  # a bounded wait, not a timing claim
        while driver_alive(info) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver_alive(info) is False  # killed, not yet reaped: a zombie
        with pytest.raises(DriverGone, match=f"pid {proc.pid}"):
            check_driver(info)
    finally:
        proc.kill()
        proc.wait()
    assert driver_alive(info) is False
    assert driver_alive({**info, "driver_host": "elsewhere"}) is None
    assert driver_alive({}) is None
    assert driver_alive(driver_identity()) is True

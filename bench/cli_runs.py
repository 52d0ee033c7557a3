"""`sft-runtime` launched as a user launches it, from a benchmark: the CLI's environment
(`cli_env`), and a whole `train` with its first step's time and every process's peak RSS
(`cli_run`), its controller and workers told apart by `process_role`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench import zygote
from bench.harness import committed, ray_root, shared_ray_address

CLI = Path(sys.executable).parent / "sft-runtime"


def _hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def actor_role(cmd: str) -> str | None:
    """``"worker"`` or ``"controller"`` for the command line of a run's actor process (Ray
    renames it after the actor's class), else None."""
    if "PolicyWorker" in cmd:
        return "worker"
    if "SFTController" in cmd or "SFTSingleController" in cmd:
        return "controller"
    return None


def process_role(proc) -> str | None:
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - gone
        return None
    role = actor_role(cmd)
    return f"worker:{proc.pid}" if role == "worker" else role


def cli_run(config_path: Path, run_dir: Path) -> dict:
    """`sft-runtime train`: seconds from launch to the first step committed by this launch,
    and the peak RSS (MiB) of the driver, the controller and the workers it started."""
    import psutil

    before = len(committed(run_dir)) if (run_dir / "events.jsonl").exists() else 0
    start = time.time()
    proc = zygote.Popen(
        [str(CLI), "train", str(config_path), "--run-dir", str(run_dir)],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    peaks: dict[str, int] = {}
    # a run that joins the shared Ray places its controller and workers under that Ray's
    # raylet, not under its own driver
    tree = ray_root() if shared_ray_address() else psutil.Process(proc.pid)
    while proc.poll() is None:
        peaks["driver"] = max(peaks.get("driver", 0), _hwm_kib(proc.pid))
        try:
            children = tree.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            role = process_role(child)
            if role is not None:
                peaks[role] = max(peaks.get(role, 0), _hwm_kib(child.pid))
        time.sleep(0.2)
    if proc.returncode:
        raise RuntimeError(f"sft-runtime train exited with {proc.returncode}")
    records = committed(run_dir)[before:]
    workers = sorted(v for k, v in peaks.items() if k.startswith("worker:"))
    rss = {k: v / 1024 for k, v in peaks.items() if not k.startswith("worker:")}
    rss.update({f"worker{i}": v / 1024 for i, v in enumerate(workers)})
    return {"first_step_s": records[0].time - start, "rss": rss}


def cli_env(*drop: str) -> dict[str, str]:
    """The environment of an `sft-runtime` child: no Ray address from outside (the run
    starts its own Ray, as a user's does), except in smoke mode the Ray the benchmark's runs
    share (`shared_ray`), which it joins as a user joins a cluster (``RAY_ADDRESS``);
    variables starting with ``drop`` left out too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", *drop))}
    env["RAY_AUTH_MODE"] = "disabled"
    address = shared_ray_address()
    if address:
        env["RAY_ADDRESS"] = address
    return env

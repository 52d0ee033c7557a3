"""CPU seconds per step of each process of a run: the controller, each worker, the loader
processes, the driver and Ray's own daemons.

On a machine with as many cores as a plain loop has processes, every CPU second the
runtime's other processes take is a second some worker waits for: these figures say where
an end-to-end overhead goes. Sampled by `runtime_run`'s ``on_step`` callback (the driver
reads committed steps about every 0.1 s); the rate over the steady window is the CPU
between two samples divided by the steps committed between them, so a late sample costs
nothing but a shorter window. CPU times count in clock ticks (10 ms): a window of 15 steps
reads to about 0.7 ms a step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import psutil


def _role(proc: psutil.Process, parent_roles: dict[int, str]) -> str | None:
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return None
    if proc.pid == os.getpid():
        return "driver"
    if "ray::SFTController" in title or "SFTSingleControllerActor" in title:
        return "controller"
    if "ray::PolicyWorker" in title:
        return "worker"
    if parent_roles.get(proc.ppid()) in ("worker", "loader"):
        return "loader"  # a worker's child: energon's data-loading processes
    if "raylet" in title or "gcs_server" in title or "ray/" in title or "ray::" in title:
        return "ray"
    return None


@dataclass
class CpuSampler:
    """Per-process CPU seconds at two committed steps the driver reports: the first at or
    after ``first`` and the first at or after ``last`` (a snapshot reads every process of
    the run, which is driver CPU the run would not spend: twice a run, not per step)."""

    first: int
    last: int
    samples: list[tuple[int, dict[tuple[str, int], float]]] = field(default_factory=list)

    def on_step(self, row: dict) -> None:
        step = int(row["step"])
        wanted = self.first if not self.samples else self.last
        if len(self.samples) < 2 and step >= wanted:
            self.samples.append((step, snapshot()))

    def per_step(self) -> dict[str, float]:
        """CPU seconds per step of each role (workers each: ``worker0``, ``worker1``, ...)
        between the two snapshots; empty when the run ended before the second."""
        if len(self.samples) < 2 or self.samples[1][0] == self.samples[0][0]:
            return {}
        (s0, a), (s1, b) = self.samples
        totals: dict[str, float] = {}
        workers = sorted(pid for role, pid in b if role == "worker")
        for (role, pid), seconds in b.items():
            key = f"worker{workers.index(pid)}" if role == "worker" else role
            totals[key] = totals.get(key, 0.0) + (seconds - a.get((role, pid), 0.0)) / (s1 - s0)
        return totals


def snapshot() -> dict[tuple[str, int], float]:
    """CPU seconds (user + system) of this process and of every process of its Ray."""
    from bench.harness import ray_root

    roles: dict[int, str] = {}
    out: dict[tuple[str, int], float] = {}
    root = ray_root()  # this benchmark's Ray (a machine may run other trainings)
    for proc in sorted([psutil.Process(), *root.children(recursive=True)], key=lambda p: p.pid):
        role = _role(proc, roles)
        if role is None:
            continue
        roles[proc.pid] = role
        try:
            cpu = proc.cpu_times()
        except psutil.Error:
            continue
        out[(role, proc.pid)] = cpu.user + cpu.system
    return out

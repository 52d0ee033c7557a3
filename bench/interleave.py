"""Step time of two sides that take turns every few steps inside one run.

This machine's speed drifts by 10% and more within a minute, so two runs one after the
other are timed at different speeds. Here both sides are up at once and take turns:
sft-runtime trains `TURN` steps while the plain loop waits on its pipe, then the runtime is
frozen (SIGSTOP on its controller, its workers and their loader processes) while the plain
loop trains the same `TURN` batches, and so on; the runtime stays frozen through the plain
loop's last turn too, so its end of run (final save, shutdown) never overlaps the plain
loop. A slow spell then falls on both sides alike.

The runtime is frozen when the poll here sees a step committed, so the step it is training
then holds the pause; that step's interval is counted without the pause, and its own
timings (which include it) are left out of the model-work share. The same turns between
two plain loops (`plain_vs_plain`) show what the method cannot cancel: two processes of
the same program, on the same batches, differ by a few percent here, from process to
process rather than from minute to minute.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from bench import harness as h
from bench.cli_runs import process_role
from bench.plain_loop import PlainTurns

TURN = 4  # steps per turn
# The poll runs on the other core while the runtime trains (about 0.1 ms of CPU a poll
# here), and the plain loop's turns have no such neighbour: its side blocks on a pipe. A
# freeze that comes late only moves the pause within the step that holds it, and that pause
# is subtracted, so a coarse poll costs no accuracy.
POLL_S = 0.01


class RuntimeTurns:
    """An sft-runtime run in a thread of this process, frozen between its turns."""

    def __init__(self, raw: dict) -> None:
        from sft_runtime.runtime.launch.driver import run_training

        self.run_dir = Path(raw["logger"]["log_dir"])
        self.pauses: list[tuple[float, float]] = []  # (frozen at, thawed at), time.time()
        self._error: BaseException | None = None
        self._seen, self._committed = 0, 0
        self._frozen: list[int] = []
        self._pids: list[int] = []  # controller, workers and their loader processes
        config = h.master_config(raw)

        def train() -> None:
            try:
                run_training(config)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiting side
                self._error = exc

        self._thread = threading.Thread(target=train, name="runtime-turns", daemon=True)
        self._thread.start()

    def until_committed(self, steps: int) -> None:
        """Wait until `steps` steps are committed (the run must be thawed)."""
        while self._committed < steps:
            if self._error is not None:
                raise RuntimeError("the sft-runtime run failed") from self._error
            if not self._thread.is_alive():
                raise RuntimeError(f"the run ended after {self._committed} of {steps} steps")
            self._read_new()
            if self._committed < steps:
                time.sleep(POLL_S)

    def _read_new(self) -> None:
        log = self.run_dir / "events.jsonl"
        try:
            if log.stat().st_size <= self._seen:
                return
            with open(log, "rb") as fh:
                fh.seek(self._seen)
                chunk = fh.read()
        except FileNotFoundError:
            return
        done = chunk.rfind(b"\n") + 1  # whole lines only
        self._seen += done
        self._committed += chunk[:done].count(b'"type":"step_committed"')

    def freeze(self) -> None:
        import psutil

        if not self._pids:  # the run's processes are all up by its first commit: scan once
            # under this benchmark's Ray only: a machine may run other trainings
            for proc in h.ray_root().children(recursive=True):
                if process_role(proc) is not None:
                    self._pids.append(proc.pid)
                    self._pids.extend(child.pid for child in proc.children(recursive=True))
        pids = self._pids
        frozen_at = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        for pid in pids:  # stopped for certain before the other side starts
            while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
                time.sleep(0.0005)
        self._frozen = pids
        self.pauses.append((frozen_at, 0.0))

    def thaw(self) -> None:
        """Let the run go on (nothing when it is not frozen)."""
        if not self._frozen:
            return
        for pid in self._frozen:
            os.kill(pid, signal.SIGCONT)
        self.pauses[-1] = (self.pauses[-1][0], time.time())
        self._frozen = []

    def finish(self) -> dict:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the sft-runtime run failed") from self._error
        records = h.committed(self.run_dir)
        intervals, held = {}, set()
        for before, rec in zip(records, records[1:], strict=False):
            paused = sum(
                max(0.0, min(rec.time, thawed) - max(before.time, frozen))
                for frozen, thawed in self.pauses
            )
            intervals[rec.data["step"]] = rec.time - before.time - paused
            if paused:
                held.add(rec.data["step"])
        return {
            "intervals": intervals,
            "held": held,  # steps that held a pause: their own timings include it
            "model_work": {r.data["step"]: h._model_work(r.data["timings"]) for r in records},
            "losses": [r.data["loss"] for r in records],
        }


def schedule(steps: int, second_opens: bool) -> list[tuple[int, int]]:
    """Turns as (side, steps). Side 0 starts with the warm-up steps; then, over the counted
    steps, side 0 goes first on each `TURN` batches, or side 1 does when `second_opens`
    (side 1 then runs its warm-up together with its first counted turn). Which side goes
    first on a batch is alternated between runs: which place is the cheaper one varies."""
    sizes = [min(h.WARMUP, steps)]
    while sum(sizes) < steps:
        sizes.append(min(TURN, steps - sum(sizes)))
    if not second_opens or len(sizes) == 1:
        return [(side, n) for n in sizes for side in (0, 1)]
    turns = [(0, sizes[0]), (1, sizes[0] + sizes[1])]
    for k in range(1, len(sizes)):
        turns.append((0, sizes[k]))
        if k + 1 < len(sizes):
            turns.append((1, sizes[k + 1]))
    return turns


def runtime_vs_plain(raw: dict, batches: Path, steps: int, plain_opens: bool = False) -> dict:
    """sft-runtime (side 0) and the plain loop (side 1) in turns over the same `steps`
    batches (`schedule`): the ratio of their summed step times after `h.WARMUP`, the
    runtime's model work over the plain steps, and both sides' losses. The runtime is frozen
    whenever the plain loop trains, its own end included."""
    plain = PlainTurns(raw, batches)
    durations: list[float] = []
    try:
        runtime = RuntimeTurns(raw)
        committed = 0
        try:
            for side, n in schedule(steps, plain_opens):
                if side == 1:
                    durations += plain.turn(n)
                    continue
                runtime.thaw()
                committed += n
                runtime.until_committed(committed)
                runtime.freeze()
        finally:
            runtime.thaw()
        ours = runtime.finish()
    finally:
        losses = plain.close()
    counted = range(h.WARMUP + 1, steps + 1)
    clean = [s for s in counted if s not in ours["held"]]
    return {
        "ratio": sum(ours["intervals"][s] for s in counted)
        / sum(durations[s - 1] for s in counted),
        "model_work_over_plain": sum(ours["model_work"][s] for s in clean)
        / sum(durations[s - 1] for s in clean),
        "losses": (losses, ours["losses"]),
    }


def plain_vs_plain(raw: dict, batches: Path, steps: int, b_opens: bool = False) -> float:
    """The same turns between two plain loops (B over A): what the method cannot cancel."""
    sides = (PlainTurns(raw, batches), PlainTurns(raw, batches))
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for side, n in schedule(steps, b_opens):
            times[side].extend(sides[side].turn(n))
    finally:
        for loop in sides:
            loop.close()
    return sum(times[1][h.WARMUP :]) / sum(times[0][h.WARMUP :])

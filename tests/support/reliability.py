"""Launch `sft-runtime train` as a user would, crash it, resume it, compare with a reference.

Each launch runs in its own session (``start_new_session=True``) with its own embedded Ray
under a short temporary root (``RAY_TMPDIR``), and carries a tag in its environment
(``SFT_RELIABILITY_TAG``). Ray starts its workers in sessions of their own, so killing the
launch's process group does not reach them; the tag is how the harness finds every process
a launch left behind (by reading ``/proc/<pid>/environ``; only this user's processes can be
read) and ends them by pid, never by name.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sft_runtime.events import compare_reexecutions, read_log, records_in_effect

BIN = Path(sys.executable).parent / "sft-runtime"
PREFETCH = ("data_plane.max_partitions=2",)  # read-ahead on: the same run, bit for bit
FSDP = ("policy.dtensor_cfg.enabled=true",)  # sharded: its own reference (sums in another order)
STEPS = 7  # checkpoints every 3 steps: 3, 6 and the final 7
TAG_VAR = "SFT_RELIABILITY_TAG"
LAUNCH_TIMEOUT_S = 300.0
ORPHAN_GRACE_S = 30.0
_counter = itertools.count(1)


# ----------------------------------------------------------------------------- processes
def tagged_pids(tag_prefix: str) -> list[int]:
    """Pids of live processes whose environment carries a tag starting with ``tag_prefix``."""
    needle = f"{TAG_VAR}={tag_prefix}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or another user's process
            continue
        if state != "Z" and any(item.startswith(needle) for item in env.split(b"\0")):
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (it may still hold files while it exits)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def reap(tag_prefix: str, grace_s: float = ORPHAN_GRACE_S) -> tuple[float, int]:
    """Wait until no process of the tag is left; SIGKILL (by pid) what outlives the grace.

    A process stays counted until it is gone or a zombie, even once its environment can no
    longer be read (an exiting process drops its memory before its files, so it may still
    hold the run's lock then). Returns (seconds the last one lived, how many had to be
    killed).
    """
    t0 = time.monotonic()
    seen: set[int] = set()
    while time.monotonic() - t0 < grace_s:
        seen.update(tagged_pids(tag_prefix))
        if not any(_running(pid) for pid in seen):
            return time.monotonic() - t0, 0
        time.sleep(0.2)
    left = [pid for pid in seen | set(tagged_pids(tag_prefix)) if _running(pid)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while any(_running(pid) for pid in left) and time.monotonic() - t0 < grace_s + 30:
        time.sleep(0.1)
    return time.monotonic() - t0, len(left)


# ----------------------------------------------------------------------------- launches
@dataclass
class Launch:
    fault: str | None
    rc: int
    output: str
    seconds: float
    orphan_seconds: float = 0.0
    orphans_killed: int = 0

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


@dataclass
class Runner:
    """One run directory, one config file, and every launch made on them."""

    root: Path
    data_dir: Path
    ray_tmp: Path
    session_tag: str
    name: str = "run"
    steps: int = STEPS
    overrides: tuple[str, ...] = ()  # dotted config overrides, e.g. read-ahead on
    launches: list[Launch] = field(default_factory=list)

    def __post_init__(self) -> None:
        from sft_runtime.runtime.config_files.overrides import apply_override
        from tests.support.small_run import small_raw

        self.run_dir = self.root / self.name
        self.config = self.root / f"{self.name}.yaml"
        raw = small_raw(self.run_dir, self.data_dir, self.steps)
        for item in self.overrides:
            apply_override(raw, item)
        self.config.write_text(yaml.safe_dump(raw))

    @property
    def command(self) -> list[str]:
        return [str(BIN), "train", str(self.config), "--run-dir", str(self.run_dir)]

    def env(
        self, tag: str, fault: str | None = None, rank: int | None = None, hold: Path | None = None
    ) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("RAY_ADDRESS") and not k.startswith("SFT_RUNTIME_FAULT")
        }
        env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(self.ray_tmp), COLUMNS="200")
        env[TAG_VAR] = tag
        if fault is not None:
            env["SFT_RUNTIME_FAULT"] = fault
            if rank is not None:
                env["SFT_RUNTIME_FAULT_RANK"] = str(rank)
            if hold is not None:
                env["SFT_RUNTIME_FAULT_HOLD"] = str(hold)
        return env

    def cli(
        self, *args: str, fault: str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """`sft-runtime ARGS` as a user types it, in this runner's environment (plus ``env``);
        every process it left is ended (by pid) before this returns."""
        tag = self.new_tag()
        try:
            return subprocess.run(
                [str(BIN), *args],
                env={**self.env(tag, fault), **(env or {})},
                capture_output=True,
                text=True,
                timeout=LAUNCH_TIMEOUT_S,
                start_new_session=True,
            )
        finally:
            reap(tag)

    def new_tag(self) -> str:
        return f"{self.session_tag}:{self.name}:{next(_counter)}"

    def start(
        self, fault: str | None = None, rank: int | None = None, hold: Path | None = None
    ) -> tuple[Any, str]:
        """Start a launch in its own session; the caller waits for it or kills it.

        With ``hold``, the process that reaches the fault point writes that file and waits
        there (see runtime/faults.py) instead of killing itself.
        """
        tag = self.new_tag()
        proc = subprocess.Popen(
            self.command,
            env=self.env(tag, fault, rank, hold),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        return proc, tag

    def wait_held(self, proc: Any, tag: str, hold: Path) -> dict[str, Any]:
        """Until the launch holds at its fault point; a launch that exits first, or never
        gets there, fails the test with its output."""
        t0 = time.monotonic()
        while not hold.exists():
            if proc.poll() is not None or time.monotonic() - t0 > LAUNCH_TIMEOUT_S:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                reap(tag, grace_s=5)
                raise AssertionError(
                    f"launch never held at {hold.name} (exit {proc.returncode}):\n{out[-4000:]}"
                )
            time.sleep(0.01)
        return json.loads(hold.read_text())

    def launch(self, fault: str | None = None, rank: int | None = None) -> Launch:
        """Run one launch to its end (a hang is killed and fails the test)."""
        t0 = time.monotonic()
        proc, tag = self.start(fault, rank)
        try:
            out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            reap(tag, grace_s=5)
            raise AssertionError(f"launch with fault {fault} hung:\n{out[-4000:]}") from None
        done = Launch(fault, proc.returncode, out, time.monotonic() - t0)
        done.orphan_seconds, done.orphans_killed = reap(tag)
        self.launches.append(done)
        return done

    def finish(self, max_launches: int = 3) -> list[Launch]:
        """Relaunch the same command without a fault until it exits 0."""
        runs = []
        for _ in range(max_launches):
            runs.append(self.launch())
            if runs[-1].rc == 0:
                return runs
            assert runs[-1].rc != 2, f"a resume was refused as bad input:\n{runs[-1].tail()}"
        raise AssertionError(f"no clean finish in {max_launches} launches:\n{runs[-1].tail()}")


# ----------------------------------------------------------------------------- comparison
def committed(run_dir: Path) -> dict[int, tuple[float, list[str]]]:
    """step -> (loss, per-rank sample digests) over the records that count."""
    return {
        r.data["step"]: (r.data["loss"], r.data["sample_digests"])
        for r in records_in_effect(read_log(run_dir))
        if r.type == "step_committed"
    }


def validations(run_dir: Path) -> dict[int, tuple[float, int, int, str]]:
    """step -> (loss, tokens, samples, sample digest) of the validations in effect."""
    return {
        r.data["step"]: (
            r.data["loss"],
            r.data["tokens"],
            r.data["samples"],
            r.data["sample_digest"],
        )
        for r in records_in_effect(read_log(run_dir))
        if r.type == "validation_completed"
    }


def weights_path(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}" / "policy" / "weights"


def load_weights(run_dir: Path, step: int) -> dict[str, Any]:
    """The checkpoint's weights, whole (a sharded checkpoint's consolidated)."""
    from sft_runtime.runtime.checkpoint.policy_files import load_weights as load

    return load(str(weights_path(run_dir, step)))


@dataclass
class Reference:
    run_dir: Path
    steps: int
    committed: dict[int, tuple[float, list[str]]]
    weights: dict[str, Any]


@dataclass
class Comparison:
    steps_compared: int
    reexecuted: int
    mismatches: list[str]
    verify_output: str


def verify(run_dir: Path) -> tuple[int, str]:
    done = subprocess.run(
        [str(BIN), "verify", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout + done.stderr


def compare(run_dir: Path, ref: Reference) -> Comparison:
    """Loss and sample digests at every step, final weights bit for bit, `verify` exit 0."""
    import torch

    mismatches = []
    got = committed(run_dir)
    if sorted(got) != sorted(ref.committed):
        mismatches.append(f"committed steps {sorted(got)} != reference {sorted(ref.committed)}")
    for step in sorted(set(got) & set(ref.committed)):
        (loss, digests), (ref_loss, ref_digests) = got[step], ref.committed[step]
        if loss != ref_loss:
            mismatches.append(f"step {step}: loss {loss!r} != reference {ref_loss!r}")
        if digests != ref_digests:
            mismatches.append(f"step {step}: sample digests differ from the reference")
    path = weights_path(run_dir, ref.steps)
    if not path.is_dir():
        mismatches.append(f"{path}: missing")
    else:
        tensors = load_weights(run_dir, ref.steps)
        if sorted(tensors) != sorted(ref.weights):
            mismatches.append("final weights: different tensor names")
        for name in sorted(set(tensors) & set(ref.weights)):
            if not torch.equal(tensors[name], ref.weights[name]):
                mismatches.append(f"final weights: {name} differs")
    rc, out = verify(run_dir)
    if rc != 0:
        mismatches.append(f"sft-runtime verify exited {rc}: {out[-2000:]}")
    reexecuted, _ = compare_reexecutions(read_log(run_dir))
    match = re.search(r"re-executed steps compared: (\d+)", out)
    if rc == 0 and (match is None or int(match.group(1)) != reexecuted):
        mismatches.append(f"verify reported {match and match.group(0)}, lineage {reexecuted}")
    return Comparison(len(set(got) & set(ref.committed)), reexecuted, mismatches, out)


def summary_line(name: str, kills: int, resumes: int, cmp: Comparison) -> str:
    return (
        f"[{name}] kills={kills} resumes={resumes} steps_compared={cmp.steps_compared} "
        f"reexecuted_steps={cmp.reexecuted} mismatches={len(cmp.mismatches)}"
    )


def attempts_of(run_dir: Path) -> dict[int, list[Any]]:
    """attempt number -> its records, in order."""
    out: dict[int, list[Any]] = {}
    if not (run_dir / "events.jsonl").is_file():
        return out
    for rec in read_log(run_dir):
        out.setdefault(rec.attempt, []).append(rec)
    return out


def dir_digest(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes' SHA-256: proof that nothing changed."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).digest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "events.lock"
    }


def rewind_copy(ref: Reference, dest: Path, step: int) -> Path:
    """A copy of the reference run as a crash right after checkpoint ``step`` leaves it.

    The log keeps its records up to and including that step's ``checkpoint_saved`` (a
    prefix of a log is a valid log) and later checkpoints are gone.
    """
    import shutil

    shutil.copytree(ref.run_dir, dest)
    lines = (dest / "events.jsonl").read_bytes().splitlines(keepends=True)
    keep = next(
        i
        for i, rec in enumerate(read_log(ref.run_dir))
        if rec.type == "checkpoint_saved" and rec.data["step"] == step
    )
    (dest / "events.jsonl").write_bytes(b"".join(lines[: keep + 1]))
    for later in (dest / "checkpoints").iterdir():
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    return dest


def train(run_dir: Path, data_dir: Path, capsys, *overrides: str) -> tuple[int, str]:
    """`sft-runtime train` in this process: (exit code the console script would give, what
    it printed)."""
    from sft_runtime.runtime.cli.main import main as cli_main
    from tests.support.small_run import small_raw

    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(yaml.safe_dump(small_raw(run_dir, data_dir, STEPS)))
    capsys.readouterr()
    try:
        rc = cli_main(["train", str(config), *overrides, "--run-dir", str(run_dir)])
    except Exception as exc:  # noqa: BLE001 - the console script prints it and exits 1
        rc, extra = 1, f"{type(exc).__name__}: {exc}"
    else:
        extra = ""
    out = capsys.readouterr()
    return rc, out.out + out.err + extra


def refused(run_dir: Path, data_dir: Path, capsys) -> str:
    """Train must exit 2 and change nothing; returns the message."""
    before = dir_digest(run_dir)
    rc, out = train(run_dir, data_dir, capsys)
    assert rc == 2, out
    assert dir_digest(run_dir) == before, "a refused resume changed saved files"
    return out

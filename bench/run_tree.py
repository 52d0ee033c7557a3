"""The whole process tree of a single-node run against TRL's: memory and the time outside steps.

A user on one machine launches ``sft-runtime train CONFIG --run-dir DIR`` with one
data-parallel worker on SmolLM2-135M-Instruct (`sft-runtime fetch-demo-model`; the demo's
identity chats, unpacked, full fine-tune in float32: bench/real_model.py's ``unpacked``
mode), a handful of steps, checkpointing off and telemetry left at the config's default
(off). The reference is TRL's SFTTrainer on the same model, conversations and steps in a
fresh process (bench/real_model_sides.py's TRL side, run as it is, with a clock added).

Memory: every ``SAMPLE_S`` seconds the launched process and ALL its descendants are read
with psutil (RSS, ``memory_info().rss``; and PSS from ``/proc/PID/smaps_rollup`` through
``memory_full_info()``, which splits shared pages between the processes that map them, so
that it adds up across a tree where RSS counts a shared library once per process). Each
process gets a role from its command line (`role`): the driver; Ray's gcs_server, raylet,
dashboard head (the API server Ray starts even with ``include_dashboard=False``), dashboard
agent, runtime-env agent, autoscaler monitor and log monitor; the controller actor, the
policy worker, idle Ray workers (prestarted ones, and any worker while it imports an actor's
class before it takes the actor's name), other. Rows: the peak of the tree's total (the sum
at one sampling instant), per role the peak of that role's sum, the workers Ray started
that never got an actor, and what sits beside the policy worker at the tree's peak.

Time: launch to exit, less the steps. The steps run from ``loaders_ready`` to the last
``step_committed`` in ``DIR/events.jsonl`` (TRL: from ``on_train_begin`` to the last
``on_step_end``), the first step's warm-up included on both sides (a row shows how much
longer the first step took than the median of the others; a busy spell of the machine moves
that a lot, so it is not counted as outside). The outside time is split at the run's
events: launch -> ``run_started`` (imports, config, Ray start, actors, the model load in
the worker's constructor), -> ``loaders_ready``, the last commit -> ``run_stopped``, ->
the driver's exit (shutdown). Within the first phase, the first moment
a process of a role is seen marks when Ray came up and when each actor began. Alone, in
fresh processes: importing the modules ``sft-runtime train`` imports before it reads the
config (torch and transformers come later, with the config's checks), and
``ray.init`` + ``ray.shutdown`` as `ensure_ray` calls them (with that Ray's own tree peak).

No target: the ratios sft-runtime / TRL are printed (the issue's informal goal is to
approach TRL). Smoke mode runs the same code on a tiny Qwen2 model built here (no
download), 3 steps; the run still starts its own Ray (the tree is what is measured).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench import zygote  # noqa: E402
from bench.cli_runs import actor_role  # noqa: E402
from bench.real_model_sides import Setup, runtime_config  # noqa: E402
from bench.table import Row  # noqa: E402

STEPS = h.pick(6, 3)
MODE = "unpacked"  # bench/real_model.py's MODES
THREADS = h.pick(h.usable_cores(), 1)  # torch threads (smoke: one, see h.SMOKE_THREADS_ENV)
SAMPLE_S = 0.15
RAY_IDLE_S = h.pick(2.0, 0.5)  # Ray alone: how long it stays up, idle, to be sampled
CLI = Path(sys.executable).parent / "sft-runtime"
MARK = "run-tree: "  # a child's result line
# what `sft-runtime train` imports before it reads the config: the CLI, the config, the
# driver (ray) and the progress display
TRAIN_IMPORTS = (
    "import sft_runtime.runtime.cli.main, sft_runtime.runtime.config, "
    "sft_runtime.runtime.launch.driver, rich.progress"
)
ROLES = (
    "driver",
    "gcs_server",
    "raylet",
    "dashboard head (API server)",
    "dashboard agent",
    "runtime_env agent",
    "autoscaler monitor",
    "log_monitor",
    "controller",
    "policy worker",
    "idle ray worker",
    "other",
)
# Ray's Python processes, by the script they run (or the title they give themselves)
RAY_SCRIPTS = (
    ("dashboard/dashboard.py", "dashboard head (API server)"),
    ("ray::DashboardAgent", "dashboard agent"),
    ("dashboard/agent.py", "dashboard agent"),
    ("ray::RuntimeEnvAgent", "runtime_env agent"),
    ("runtime_env/agent/main.py", "runtime_env agent"),
    ("autoscaler/_private/monitor.py", "autoscaler monitor"),
    ("_private/log_monitor.py", "log_monitor"),
)


def role(cmdline: list[str], is_root: bool) -> str:
    """What a process of the tree is, from its command line (Ray's workers rename theirs:
    ``ray::IDLE``, ``ray::PolicyWorker.train``, ...). Ray's binaries go by their own name
    first: the raylet's command line holds the agents' command lines."""
    if is_root:
        return "driver"
    binary = os.path.basename(cmdline[0]) if cmdline else ""
    if binary in ("raylet", "gcs_server"):
        return binary
    cmd = " ".join(cmdline)
    actor = actor_role(cmd)
    if actor is not None:
        return "policy worker" if actor == "worker" else actor
    for script, name in RAY_SCRIPTS:
        if script in cmd:
            return name
    if "ray::IDLE" in cmd or "default_worker.py" in cmd:
        return "idle ray worker"
    return "other"


@dataclass
class Tree:
    """What a `TreeSampler` saw: peaks in MiB, and when each role first appeared."""

    peak_rss: float = 0.0  # the tree's total at one instant
    peak_pss: float = 0.0
    role_rss: dict[str, float] = field(default_factory=dict)  # each role's own peak sum
    role_pss: dict[str, float] = field(default_factory=dict)
    role_count: dict[str, int] = field(default_factory=dict)  # most processes at once
    at_peak: dict[str, float] = field(default_factory=dict)  # RSS by role at the total's peak
    first_seen: dict[str, float] = field(default_factory=dict)  # unix time
    others: set[str] = field(default_factory=set)  # command lines of role "other"
    pid_roles: dict[int, list[str]] = field(default_factory=dict)  # each process's roles in turn
    pid_rss: dict[int, float] = field(default_factory=dict)  # each process's peak
    samples: int = 0

    def unused_idle(self) -> tuple[int, float]:
        """(how many, summed peak RSS) of the Ray workers that stayed idle all along: started
        ahead (prestarted) but never given an actor."""
        idle = [pid for pid, roles in self.pid_roles.items() if roles == ["idle ray worker"]]
        return len(idle), sum(self.pid_rss[pid] for pid in idle)


class TreeSampler:
    """Samples process ``pid`` and all its descendants every ``period`` s in a thread."""

    def __init__(self, pid: int, period: float = SAMPLE_S) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.period = period
        self.tree = Tree()
        self._procs: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def _members(self) -> list:
        import psutil

        try:
            members = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []
        # the same Process objects from one sample to the next (psutil caches per object)
        procs = {}
        for proc in members:
            procs[proc.pid] = self._procs.get(proc.pid, proc)
        self._procs = procs
        return list(procs.values())

    def sample(self) -> None:
        import psutil

        now = time.time()
        rss: dict[str, float] = {}
        pss: dict[str, float] = {}
        count: dict[str, int] = {}
        for proc in self._members():
            try:
                cmdline = proc.cmdline()
                if not cmdline:
                    continue  # exiting (a zombie): no memory left
                name = role(cmdline, proc.pid == self.root.pid)
                mem = proc.memory_full_info()  # rss and pss, from smaps_rollup
            except psutil.Error:
                continue  # gone meanwhile
            rss[name] = rss.get(name, 0.0) + mem.rss / 2**20
            pss[name] = pss.get(name, 0.0) + mem.pss / 2**20
            count[name] = count.get(name, 0) + 1
            if name == "other":
                self.tree.others.add(" ".join(cmdline)[:120])
            self.tree.pid_rss[proc.pid] = max(self.tree.pid_rss.get(proc.pid, 0.0), mem.rss / 2**20)
            seen = self.tree.pid_roles.setdefault(proc.pid, [])
            if not seen or seen[-1] != name:
                seen.append(name)
        t = self.tree
        t.samples += 1
        for name in rss:
            t.first_seen.setdefault(name, now)
            t.role_rss[name] = max(t.role_rss.get(name, 0.0), rss[name])
            t.role_pss[name] = max(t.role_pss.get(name, 0.0), pss[name])
            t.role_count[name] = max(t.role_count.get(name, 0), count[name])
        if sum(rss.values()) > t.peak_rss:
            t.peak_rss = sum(rss.values())
            t.at_peak = dict(rss)
        t.peak_pss = max(t.peak_pss, sum(pss.values()))


def launched(argv: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """``argv`` as a fresh process, its tree sampled: launch and exit times, the `Tree`,
    and the result line it printed (after ``MARK``), if any."""
    with open(log, "w") as out:
        start = time.time()
        proc = zygote.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        with TreeSampler(proc.pid) as sampler:
            code = proc.wait()
            end = time.time()
    text = log.read_text()
    if code:
        raise RuntimeError(f"{' '.join(argv[:3])} exited with {code}:\n{text[-4000:]}")
    marked = [line for line in text.splitlines() if line.startswith(MARK)]
    result = json.loads(marked[-1][len(MARK) :]) if marked else {}
    return {"start": start, "end": end, "tree": sampler.tree, "result": result}


def child_env() -> dict[str, str]:
    """A user's environment: the run starts its own Ray (never the Ray a smoke run of
    `run_all.py` shares: this benchmark measures the tree a run starts)."""
    drop = ("RAY_ADDRESS", h.SHARED_RAY_ENV, h.SHARED_RAY_PID_ENV, "OTEL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["RAY_AUTH_MODE"] = "disabled"
    env.setdefault("TQDM_DISABLE", "1")
    return env


def _steps(begin: float, ends: list[float]) -> dict[str, float]:
    """The steps from their start and each one's end: their seconds, the median step after
    the first, and how much longer the first took (warm-up)."""
    median = statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))
    return {"steps_s": ends[-1] - begin, "step_s": median, "warmup_s": ends[0] - begin - median}


# ----------------------------------------------------------------------------- sft-runtime
def runtime_side(
    setup: Setup,
    scratch: Path,
    env: dict[str, str],
    cli: tuple[str, ...] = (str(CLI),),
    name: str = "runtime",
) -> dict[str, Any]:
    """``sft-runtime train`` as a user runs it (``cli``: the command that stands for
    ``sft-runtime``); its tree and the phases of its wall time."""
    import yaml

    from sft_runtime.events import read_log

    run_dir = scratch / f"{name}-run"
    config = scratch / f"{name}.yaml"
    config.write_text(yaml.safe_dump(runtime_config(setup, run_dir)))
    got = launched(
        [*cli, "train", str(config), "--run-dir", str(run_dir)],
        env,
        scratch / f"{name}.log",
    )
    records = list(read_log(run_dir))
    first = {}
    for r in records:
        first.setdefault(r.type, r.time)
    commits = [r.time for r in records if r.type == "step_committed"]
    if len(commits) != setup.steps:
        raise RuntimeError(f"{len(commits)} steps committed, {setup.steps} expected")
    start, end = got["start"], got["end"]
    phases = {
        "launch -> run_started (imports, config, Ray, actors, model load)": first["run_started"]
        - start,
        "run_started -> loaders_ready": first["loaders_ready"] - first["run_started"],
        "last step -> run_stopped": first["run_stopped"] - commits[-1],
        "run_stopped -> exit (shutdown)": end - first["run_stopped"],
    }
    # within the first phase: when Ray and each actor came up (first seen, +- SAMPLE_S)
    seen = got["tree"].first_seen
    marks = {}
    for name, label in (
        ("gcs_server", "launch -> gcs_server seen (Ray starts)"),
        ("policy worker", "launch -> policy worker actor seen"),
        ("controller", "launch -> controller actor seen"),
    ):
        if name in seen:
            marks[label] = seen[name] - start
    return {
        "wall_s": end - start,
        **_steps(first["loaders_ready"], commits),
        "phases": phases,
        "marks": marks,
        "tree": got["tree"],
    }


def import_side(env: dict[str, str], scratch: Path) -> dict[str, Any]:
    """Importing what `sft-runtime train` imports before it reads the config, in a fresh process:
    the interpreter's start and the imports, from launch to exit."""
    code = f"import time; t = time.time(); {TRAIN_IMPORTS}; print({MARK!r} + str(time.time() - t))"
    got = launched([sys.executable, "-c", code], env, scratch / "imports.log")
    return {"wall_s": got["end"] - got["start"], "imports_s": float(got["result"])}


def ray_side(env: dict[str, str], scratch: Path) -> dict[str, Any]:
    """``ray.init`` and ``ray.shutdown`` alone, as `ensure_ray` calls them, in a fresh
    process: their seconds and the tree's peak while Ray is up."""
    got = launched([sys.executable, __file__, "--ray-child"], env, scratch / "ray.log")
    return {**got["result"], "tree": got["tree"], "wall_s": got["end"] - got["start"]}


def ray_child() -> dict[str, float]:
    import ray

    from sft_runtime.runtime.launch.setup import ensure_ray
    from sft_runtime.runtime.policy.cluster_config import ClusterConfig

    cluster = ClusterConfig.model_validate(
        {"gpus_per_node": 0, "workers_per_node": 1, "num_threads_per_worker": 1}
    )
    t0 = time.time()
    ensure_ray(cluster)
    t1 = time.time()
    time.sleep(RAY_IDLE_S)  # up, idle: what it holds before anything is placed on it
    t2 = time.time()
    ray.shutdown()
    t3 = time.time()
    return {"init_s": t1 - t0, "shutdown_s": t3 - t2}


# ----------------------------------------------------------------------------- TRL
def trl_side(setup_file: Path, scratch: Path, env: dict[str, str]) -> dict[str, Any]:
    work = scratch / "trl-work"
    work.mkdir()
    got = launched(
        [sys.executable, __file__, "--trl-child", str(setup_file), str(work)],
        env,
        scratch / "trl.log",
    )
    marks = got["result"]
    ends = marks["step_ends"]
    start, end = got["start"], got["end"]
    phases = {
        "launch -> SFTTrainer() (imports, tokenizer, model load)": marks["init_begin"] - start,
        "SFTTrainer() (data set tokenized, accelerate)": marks["init_end"] - marks["init_begin"],
        "SFTTrainer() -> train begins": marks["train_begin"] - marks["init_end"],
        "last step -> exit": end - ends[-1],
    }
    return {
        "wall_s": end - start,
        **_steps(marks["train_begin"], ends),
        "phases": phases,
        "tree": got["tree"],
    }


def trl_child(setup_file: str, work: str) -> dict[str, Any]:
    """bench/real_model_sides.py's TRL side as it is, with a wall clock on the trainer:
    when it is built, when training begins and when each step ends."""
    import trl
    from transformers import TrainerCallback

    marks: dict[str, Any] = {"step_ends": []}

    class WallClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_begin"] = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            marks["step_ends"].append(time.time())

    class Clocked(trl.SFTTrainer):
        def __init__(self, *args, callbacks=None, **kwargs):
            marks["init_begin"] = time.time()
            super().__init__(*args, callbacks=[*(callbacks or []), WallClock()], **kwargs)
            marks["init_end"] = time.time()

    trl.SFTTrainer = Clocked  # train_trl imports it from trl when it runs
    from bench.real_model_sides import run_side

    run_side("trl", setup_file, work)
    return marks


# ----------------------------------------------------------------------------- rows
def _vs_trl(name: str, ours: float, trl: float, unit: str) -> Row:
    return Row(
        name=name, value=ours, unit=unit, reference=trl, ratio=ours / trl if trl > 0 else None
    )


def _rows(ours: dict, trl: dict, imports: dict, ray_alone: dict, setup: Setup) -> list[Row]:
    tree, ref = ours["tree"], trl["tree"]
    rows = [
        _vs_trl(
            "tree peak RSS (sum at one instant), sft-runtime vs TRL",
            tree.peak_rss,
            ref.peak_rss,
            "MiB",
        ),
        _vs_trl(
            "tree peak PSS (shared pages split), sft-runtime vs TRL",
            tree.peak_pss,
            ref.peak_pss,
            "MiB",
        ),
        _vs_trl(
            "time outside steps (launch to exit less the steps), sft-runtime vs TRL",
            ours["wall_s"] - ours["steps_s"],
            trl["wall_s"] - trl["steps_s"],
            "s",
        ),
        _vs_trl(
            f"launch to exit ({setup.steps} steps), sft-runtime vs TRL",
            ours["wall_s"],
            trl["wall_s"],
            "s",
        ),
        _vs_trl(
            "median step after the first, sft-runtime vs TRL", ours["step_s"], trl["step_s"], "s"
        ),
        _vs_trl(
            "first step less that median (warm-up; in the steps), sft-runtime vs TRL",
            ours["warmup_s"],
            trl["warmup_s"],
            "s",
        ),
    ]
    # where the memory goes: each role's own peak (its processes summed at one instant)
    for name in ROLES:
        if name in tree.role_rss:
            label = (
                f"RSS {name} x{tree.role_count[name]} (PSS {tree.role_pss[name]:,.0f}; "
                f"at the tree's peak {tree.at_peak.get(name, 0.0):,.0f})"
            )
            rows.append(Row(name=label, value=tree.role_rss[name], unit="MiB"))
    unused, unused_rss = tree.unused_idle()
    rows.append(
        Row(
            name=f"RSS of Ray workers started but never given an actor x{unused}",
            value=unused_rss,
            unit="MiB",
        )
    )
    beside = tree.peak_rss - tree.at_peak.get("policy worker", 0.0)
    rows.append(
        Row(name="RSS beside the policy worker at the tree's peak", value=beside, unit="MiB")
    )
    rows.append(
        Row(
            name=f"RSS of Ray alone, tree peak (ensure_ray, idle {RAY_IDLE_S:g} s; PSS "
            f"{ray_alone['tree'].peak_pss:,.0f})",
            value=ray_alone["tree"].peak_rss,
            unit="MiB",
        )
    )
    # where the time goes
    rows += [Row(name=f"time: {label}", value=s, unit="s") for label, s in ours["phases"].items()]
    rows += [
        Row(name=f"time mark: {label}", value=s, unit="s") for label, s in ours["marks"].items()
    ]
    rows += [
        Row(
            name="time alone: python + the CLI's imports (before the config is read)",
            value=imports["wall_s"],
            unit="s",
        ),
        Row(name="time alone: the imports themselves", value=imports["imports_s"], unit="s"),
        Row(name="time alone: ray.init (ensure_ray)", value=ray_alone["init_s"], unit="s"),
        Row(name="time alone: ray.shutdown", value=ray_alone["shutdown_s"], unit="s"),
    ]
    rows += [
        Row(name=f"TRL time: {label}", value=s, unit="s") for label, s in trl["phases"].items()
    ]
    return rows


def run() -> list[dict]:
    from bench.real_model import MODES, _data, _model

    # a short name: Ray's socket paths under it stay within AF_UNIX's 107 bytes
    scratch = Path(tempfile.mkdtemp(prefix="tree-"))
    try:
        env = child_env()
        env["RAY_TMPDIR"] = str(scratch / "ray")  # the runs' Ray session files go with it
        model, template = _model(scratch)
        shape = MODES[MODE]
        chats, data = _data(scratch, model, count=shape["rows"] * STEPS * 2)
        setup = Setup(
            model_dir=str(model),
            data_dir=str(data),
            chats=str(chats),
            generation_template=template,
            steps=STEPS,
            warmup=0,
            seq=256,
            threads=THREADS,
            **shape,
        )
        setup_file = scratch / "setup.json"
        setup_file.write_text(json.dumps(asdict(setup)))
        imports = import_side(env, scratch)
        ray_alone = ray_side(env, scratch)
        trl = trl_side(setup_file, scratch, env)
        ours = runtime_side(setup, scratch, env)
        rows = _rows(ours, trl, imports, ray_alone, setup)
        if ours["tree"].others:
            print("run_tree.py: processes of role 'other':", file=sys.stderr)
            for cmd in sorted(ours["tree"].others):
                print(f"  {cmd}", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return [row.as_dict() for row in rows]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trl-child"]:
        print(MARK + json.dumps(trl_child(sys.argv[2], sys.argv[3])), flush=True)
        sys.exit(0)
    if sys.argv[1:2] == ["--ray-child"]:
        print(MARK + json.dumps(ray_child()), flush=True)
        sys.exit(0)
    h.main(run, __doc__)

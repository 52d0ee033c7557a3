"""Two revisions of this repository train the same runs bit for bit.

A change meant to move code around (a controller split into other modules, workers in a
package of their own) must leave every number a run produces as it was. This script trains
three small runs with each revision, through that revision's own CLI, on one data set, one
model folder and one config file per run, and compares what the runs wrote:

- every ``step_committed`` record's loss, grad_norm and sample digests, as bits;
- the bytes (sha256) of every file under ``checkpoints/step_*/policy/weights`` and
  ``.../policy/optimizer``; in FSDP's index files the save's folder and uuid are blanked
  first (`DCP_INDEX`): they alone differ between two runs of one revision.

The runs: the built-in toy model on 2 CPU workers (8 steps, a checkpoint every 3); a tiny
Llama built offline, sharded with FSDP (6 steps); LoRA adapters on that Llama, whole replicas
(6 steps).

A revision is imported without installing it: links named as the import names
(``sft_runtime/runtime`` -> the tree's ``runtime``, ...), as `make typecheck` makes them,
first on PYTHONPATH, and every child checks that ``sft_runtime.runtime`` came through those
links from the intended tree, not from the venv's editable install (whose finder answers
only for what nothing on sys.path holds). Ray's worker processes are checked too, once per
revision: a task and an actor in an embedded Ray started from the runs' environment.

    .venv/bin/python bench/same_run.py --base 09f1cef            # against the working tree
    .venv/bin/python bench/same_run.py --base HEAD~2 --head HEAD

Exit status: 0 when every run agrees, 1 on any difference or failed run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = Path("/tmp/same_run")  # a folder per invocation: its worktrees, configs and runs
IMPORT_LINKS = ("runtime", "states", "events", "traces")  # sft_runtime.<name> -> <tree>/<name>
TOP_FILES = ("__init__.py", "sft_v2.py")  # <tree>/sft_runtime/<file>
RUN_TIMEOUT_S = 1800  # one run on a busy 2-core machine takes a minute or two

# torch.distributed.checkpoint's index of a sharded save (FSDP runs). Two runs of the SAME
# revision write it differently (seen with `--base HEAD`) in two fields alone:
# storage_meta.checkpoint_id, the folder it was written to (the run's own path), and
# storage_meta.save_id, a random uuid per save. It is compared with those two blanked; the
# rest (every tensor's shape, dtype, chunks and byte offsets in the .distcp files) as is.
DCP_INDEX = ".metadata"


@dataclass
class Side:
    """One revision: its source tree and the import folder that points into it."""

    label: str  # what the user named (a revision, or the working tree)
    tree: Path
    pkg: Path  # holds sft_runtime/, first on the children's PYTHONPATH
    work: Path  # the children's cwd and the runs' parent folder
    worktree: bool = False  # made here with `git worktree add`: removed at the end


# ----------------------------------------------------------------------------- source trees
def git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def make_side(name: str | None, scratch: Path, role: str) -> Side:
    """The working tree (``name`` None), a folder given as is, or a revision checked out in a
    detached worktree in this invocation's own folder (two invocations, or a base and a head
    of one revision, never share one)."""
    work = scratch / role
    work.mkdir(parents=True)
    if name is None:
        side = Side("working tree", ROOT, scratch / f"pkg-{role}", work)
    elif Path(name).is_dir() and (Path(name) / "runtime").is_dir():
        side = Side(name, Path(name).resolve(), scratch / f"pkg-{role}", work)
    else:
        sha = git("rev-parse", "--verify", f"{name}^{{commit}}")
        tree = scratch / f"{role}-{sha[:12]}"
        git("worktree", "add", "--detach", str(tree), sha)
        side = Side(f"{name} ({sha[:9]})", tree, scratch / f"pkg-{role}", work, worktree=True)
    link_package(side.tree, side.pkg)
    return side


def link_package(tree: Path, pkg: Path) -> None:
    """``pkg/sft_runtime`` with the installed package's layout, made of links into ``tree``."""
    top = pkg / "sft_runtime"
    top.mkdir(parents=True)
    for name in IMPORT_LINKS:
        (top / name).symlink_to(tree / name, target_is_directory=True)
    for name in TOP_FILES:
        (top / name).symlink_to(tree / "sft_runtime" / name)


def remove_side(side: Side) -> None:
    if side.worktree:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(side.tree)],
            check=False,
            capture_output=True,
        )


def cli_entry(tree: Path) -> tuple[str, str]:
    """(module, function) of the tree's own `sft-runtime` console script."""
    text = (tree / "pyproject.toml").read_text()
    found = re.search(r'^sft-runtime = "([\w.]+):(\w+)"$', text, re.M)
    if found is None:
        raise SystemExit(f"{tree}/pyproject.toml: no sft-runtime console script")
    return found[1], found[2]


# ----------------------------------------------------------------------------- children
def child_env(side: Side) -> dict[str, str]:
    """The same environment for both revisions but the import folder."""
    env = {
        k: v
        for k, v in os.environ.items()
        # a Ray to join, a fault to inject, telemetry to send, another import path: none
        # of them belongs to these runs
        if not k.startswith(("RAY_ADDRESS", "OTEL_", "SFT_RUNTIME_", "PYTHON"))
    }
    env["PYTHONPATH"] = str(side.pkg)
    env["PYTHONHASHSEED"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_TMPDIR"] = str(side.work)  # the session folder of each run's own Ray
    # one intra-op thread in every process: two workers and a controller share 2 busy cores
    # (a team of two threads spin-waits for a core another process holds); both revisions
    # run with it, so it cannot make them differ
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    return env


# Run in the child before anything else: sft_runtime.runtime must come through the links
# in PKG (not the editable install's finder) and resolve into TREE.
_IMPORT_CHECK = """
import sys
from pathlib import Path

def where():
    import sft_runtime, sft_runtime.events, sft_runtime.runtime, sft_runtime.states
    import sft_runtime.traces
    mods = (sft_runtime, sft_runtime.runtime, sft_runtime.events, sft_runtime.states,
            sft_runtime.traces)
    return {m.__name__: (m.__file__, str(Path(m.__file__).resolve())) for m in mods}

def check(found, pkg, tree):
    for name, (file, resolved) in found.items():
        if not (Path(file).is_relative_to(pkg) and Path(resolved).is_relative_to(tree)):
            sys.exit(f"{name} imported from {file} ({resolved}), not {tree} through {pkg}")
"""

_RUN_WRAPPER = (
    _IMPORT_CHECK
    + """
PKG, TREE, MODULE, FUNC = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
found = where()
check(found, PKG, TREE)
print("sft_runtime.runtime:", found["sft_runtime.runtime"][1], flush=True)
sys.argv = ["sft-runtime", *sys.argv[5:]]
import importlib
sys.exit(getattr(importlib.import_module(MODULE), FUNC)())
"""
)

_RAY_CHECK = (
    _IMPORT_CHECK
    + """
import json, os
import ray
PKG, TREE = Path(sys.argv[1]), Path(sys.argv[2])
check(where(), PKG, TREE)
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")

@ray.remote(num_cpus=0.5)
def task():
    return os.getpid(), where()

@ray.remote(num_cpus=0.5)
class Actor:
    def where(self):
        return os.getpid(), where()

try:
    answers = ray.get([task.remote(), Actor.remote().where.remote()])
finally:
    ray.shutdown()
for pid, found in answers:
    if pid == os.getpid():
        sys.exit("a Ray call ran in the driver, not in a worker")
    check(found, PKG, TREE)
print(json.dumps([found["sft_runtime.runtime"][1] for _, found in answers]))
"""
)


def check_imports(side: Side) -> str:
    """The driver and two Ray workers (a task's and an actor's) import ``side``'s tree."""
    done = subprocess.run(
        [sys.executable, "-c", _RAY_CHECK, str(side.pkg), str(side.tree)],
        cwd=side.work,  # a folder without sft_runtime/ (sys.path[0] is the cwd under -c)
        env=child_env(side),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"{side.label}: import check failed:\n{done.stdout}{done.stderr}")
    workers = json.loads(done.stdout.strip().splitlines()[-1])
    return workers[0]


def train(side: Side, run: str, config: Path) -> Path:
    run_dir = side.work / run / "run"
    run_dir.parent.mkdir(parents=True)
    module, func = cli_entry(side.tree)
    argv = ["train", str(config), "--run-dir", str(run_dir)]
    log = run_dir.parent / "output.txt"
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, "-c", _RUN_WRAPPER, str(side.pkg), str(side.tree), module, func]
            + argv,
            cwd=side.work,
            env=child_env(side),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT_S,
        )
    text = log.read_text()
    first = text.splitlines()[0] if text else ""
    print(f"  {side.label}: {run}: exit {done.returncode}; {first}", flush=True)
    if done.returncode != 0:
        tail = "\n".join(text.splitlines()[-30:])
        raise RunFailed(f"{side.label}: {run} exited {done.returncode}:\n{tail}")
    return run_dir


class RunFailed(Exception):
    pass


# ----------------------------------------------------------------------------- the runs
TOY_STEPS, HF_STEPS = 8, 6
FSDP = ("policy.dtensor_cfg.enabled=true", "policy.dtensor_cfg.activation_checkpointing=true")
LORA = (
    "policy.dtensor_cfg.lora_cfg.enabled=true",
    "policy.dtensor_cfg.lora_cfg.dim=4",
    "policy.dtensor_cfg.lora_cfg.alpha=8",
)
STEPS = {"toy": TOY_STEPS, "hf_fsdp": HF_STEPS, "lora": HF_STEPS}
RUNS = tuple(STEPS)


def write_configs(scratch: Path) -> dict[str, Path]:
    """One data set, one tiny Llama folder and one config file per run, built here once (by
    the working tree's code) and read by both revisions unchanged."""
    import yaml

    from sft_runtime.runtime.config import validate_config
    from sft_runtime.runtime.config_files.overrides import apply_override
    from sft_runtime.runtime.data.demo import build_demo_dataset
    from tests.support.fixtures import hf_overrides
    from tests.support.hf_models import hf_model_dir
    from tests.support.small_run import small_raw

    data = build_demo_dataset(scratch / "data" / "demo", num_samples=256, seed=0)
    model = hf_model_dir(scratch / "tiny-llama", family="llama")
    wanted = {
        "toy": (TOY_STEPS, ()),  # small_raw's own save_period: 3
        "hf_fsdp": (HF_STEPS, (*hf_overrides(model), *FSDP)),  # save_period 2
        "lora": (HF_STEPS, (*hf_overrides(model), *LORA)),
    }
    paths = {}
    for run, (steps, overrides) in wanted.items():
        raw = small_raw(scratch / "unused", data, steps)
        for item in overrides:
            apply_override(raw, item)
        del raw["logger"]["log_dir"]  # each run's --run-dir says it
        validate_config({**raw, "logger": {**raw["logger"], "log_dir": str(scratch / "x")}})
        paths[run] = scratch / "configs" / f"{run}.yaml"
        paths[run].parent.mkdir(exist_ok=True)
        paths[run].write_text(yaml.safe_dump(raw, sort_keys=True))
    return paths


# ----------------------------------------------------------------------------- comparison
class Bits(float):
    """A logged number compared by its IEEE bits (so -0.0 != 0.0), printed as a float."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and struct.pack(">d", self) == struct.pack(">d", other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = float.__hash__


def float_bits(x) -> Bits | None:
    """None stays None: the log writes a NaN as null."""
    return None if x is None else Bits(x)


def committed_steps(run_dir: Path) -> dict[int, dict]:
    """step -> loss, grad_norm (as bits) and sample digests of each step_committed line.
    The runs start once and are never resumed, so every such line is in effect."""
    out = {}
    with open(run_dir / "events.jsonl", "rb") as fh:
        for line in fh:
            record = json.loads(line)
            if record["type"] == "step_committed":
                d = record["data"]
                out[d["step"]] = {
                    "loss": float_bits(d["loss"]),
                    "grad_norm": float_bits(d["grad_norm"]),
                    "sample_digests": d["sample_digests"],
                }
    return out


def checkpoint_files(run_dir: Path) -> dict[str, str]:
    """relative path (from checkpoints/) -> sha256 of every weights and optimizer file."""
    root = run_dir / "checkpoints"
    out = {}
    for step in sorted(root.glob("step_*")):
        for part in ("weights", "optimizer"):
            folder = step / "policy" / part
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                data = path.read_bytes()
                if path.name == DCP_INDEX:
                    data = dcp_index_without_paths(data)
                out[str(path.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


def dcp_index_without_paths(data: bytes) -> bytes:
    """A DCP index pickled again with its save's folder and uuid left out (`DCP_INDEX`)."""
    import dataclasses
    import pickle

    index = pickle.loads(data)  # written by the runs just made
    if index.storage_meta is not None:
        blank = dataclasses.replace(index.storage_meta, checkpoint_id=None, save_id=None)
        index = dataclasses.replace(index, storage_meta=blank)
    return pickle.dumps(index, protocol=4)


def compare(base: Path, head: Path, steps: int) -> tuple[int, int, str]:
    """(steps compared, checkpoint files compared, "identical" or the first difference)."""
    steps_a, steps_b = committed_steps(base), committed_steps(head)
    files_a, files_b = checkpoint_files(base), checkpoint_files(head)
    found = first_difference(steps_a, steps_b, files_a, files_b, steps)
    return len(steps_a), len(files_a), found or "identical"


def first_difference(
    steps_a: dict, steps_b: dict, files_a: dict, files_b: dict, steps: int
) -> str | None:
    for name, got in (("base", steps_a), ("head", steps_b)):
        if sorted(got) != list(range(1, steps + 1)):  # two runs that both stop early agree
            return f"{name} committed steps {sorted(got)}, not 1..{steps}"
    for step in range(1, steps + 1):
        for key in ("loss", "grad_norm", "sample_digests"):
            a, b = steps_a[step][key], steps_b[step][key]
            if a != b:
                return f"step {step} {key}: {a!r} vs {b!r}"
    if not files_a:
        return "no checkpoint files"
    if sorted(files_a) != sorted(files_b):
        only = sorted(set(files_a) ^ set(files_b))
        return f"checkpoint files differ in name: {', '.join(only[:3])}"
    for rel in sorted(files_a):
        if files_a[rel] != files_b[rel]:
            return f"{rel}: bytes differ"
    return None


def table(rows: list[tuple[str, str, str, str]]) -> str:
    head = ("run", "steps", "ckpt files", "result")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a git revision")
    parser.add_argument(
        "--head", default=None, help="a git revision or a source tree (default: the working tree)"
    )
    parser.add_argument("--runs", default=",".join(RUNS), help=f"a subset of {','.join(RUNS)}")
    parser.add_argument("--keep", action="store_true", help="keep the runs (printed folder)")
    args = parser.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    if not runs or set(runs) - set(RUNS):
        parser.error(f"--runs: choose from {','.join(RUNS)}")

    SCRATCH.mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="work-", dir=SCRATCH))
    sides: list[Side] = []
    rows = []
    try:
        sides.append(make_side(args.base, scratch, "base"))
        sides.append(make_side(args.head, scratch, "head"))
        for side in sides:
            print(f"{side.label}: {side.tree}", flush=True)
            print(f"  Ray worker imports sft_runtime.runtime from {check_imports(side)}")
        configs = write_configs(scratch)
        for run in runs:
            try:
                base_dir = train(sides[0], run, configs[run])
                head_dir = train(sides[1], run, configs[run])
            except RunFailed as exc:
                print(exc, flush=True)
                rows.append((run, "-", "-", f"run failed: {str(exc).splitlines()[0]}"))
                continue
            steps, files, verdict = compare(base_dir, head_dir, STEPS[run])
            rows.append((run, str(steps), str(files), verdict))
    finally:
        for side in sides:
            remove_side(side)
        if args.keep:
            print(f"runs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{sides[0].label} vs {sides[1].label}")
    print(table(rows))
    return 0 if rows and all(r[3] == "identical" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

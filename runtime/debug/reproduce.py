"""Re-execute a run's steps on the current code in a scratch directory, and compare.

A scratch run directory gets exactly what a resume from checkpoint K needs: a copy of
``step_K`` and the event log cut right after that checkpoint's ``checkpoint_saved`` record
(a prefix of a hash chain is a valid chain, and the resume rules then pick step K: the log
and the disk both vouch for it, and nothing newer exists). The ordinary resume then trains
steps K+1..M with the run's own config, as the checkpoint recorded it, so the comparison
with the original log (`events.run_diff`) is a determinism check of whatever changed since:
the code, or an override the user passes. The original run directory is only read.

Settings that cannot change what a step computes are pinned so the re-run is self-contained:
its log and checkpoints go to the scratch directory, it stops after step M, no deadline
stops it early, and telemetry is off unless an override turns it on again. Where the job
runs is the user's to say, never the checkpoint's (a run directory may come from anyone):
of the ``cluster`` section only the keys that decide the numbers are taken from the file;
the Ray address, placement, niceness and timeouts come from the user's overrides, or the
defaults and ``RAY_ADDRESS``, as for any run they start.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sft_runtime.events.log import LOG_NAME
from sft_runtime.events.run_diff import RunDiff, diff_runs
from sft_runtime.runtime.debug.start import StartPoint
from sft_runtime.runtime.errors import UserInputError

CONFIG_NAME = "config.yaml"
QUIET = ("telemetry=null",)  # before the user's overrides, which may turn it on again
#: The ``cluster`` keys a re-run takes from the checkpoint: the data-parallel size, CPU or
#: GPU, and the threads per worker decide what a step computes. The others place the job.
CLUSTER_COMPUTE_KEYS = ("num_nodes", "workers_per_node", "gpus_per_node", "num_threads_per_worker")


@dataclass(frozen=True)
class Reproduction:
    start: StartPoint
    scratch: Path
    diff: RunDiff  # A: the original log, B: the re-execution, over steps K+1..M
    summary: dict[str, Any]


def check_scratch(run_dir: Path, scratch: Path) -> None:
    """A scratch directory is empty (or new) and lies neither in the run nor around it."""
    run, here = run_dir.resolve(), scratch.resolve()
    if here == run or run in here.parents or here in run.parents:
        raise UserInputError(
            f"--scratch {scratch}: must lie outside the run directory {run_dir} (and not hold it)"
        )
    if here.exists() and (not here.is_dir() or any(here.iterdir())):
        raise UserInputError(f"--scratch {scratch}: exists and is not an empty directory")


def reproduce_config(start: StartPoint, scratch: Path, overrides: Sequence[str] = ()) -> Any:
    """The run's config from checkpoint K (the computation; where to run is the user's, see
    the module docstring), with the user's overrides, validated by the current code (bad
    input raises `UserInputError`), and pointed at ``scratch``."""
    from sft_runtime.runtime.config import validate_config
    from sft_runtime.runtime.config_files.overrides import apply_override

    path = start.checkpoint_path / CONFIG_NAME
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserInputError(
            f"{path}: missing; the checkpoint does not say how it was made"
        ) from None
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError(f"{path}: unreadable ({exc})") from None
    if not isinstance(raw, dict):
        raise UserInputError(f"{path}: the config must be a mapping of sections")
    cluster = raw.get("cluster")
    if isinstance(cluster, dict):  # where to run: the user's, not the file's
        raw["cluster"] = {k: v for k, v in cluster.items() if k in CLUSTER_COMPUTE_KEYS}
    for item in (*QUIET, *overrides):
        apply_override(raw, item)
    # set as values, not parsed overrides: a path must stay a string whatever it looks like
    raw.setdefault("logger", {})["log_dir"] = str(scratch)
    checkpointing = raw.setdefault("checkpointing", {})
    checkpointing["checkpoint_dir"] = str(scratch / "checkpoints")
    checkpointing["checkpoint_must_save_by"] = None
    # an override that changes a step is the question asked here, not a mistake: the
    # re-execution takes it, and its run_started records it (runtime/resume/config_change.py)
    checkpointing["allow_config_change"] = True
    raw.setdefault("sft", {})["max_num_steps"] = start.until
    return validate_config(raw, source=f"{path} (checked by the current code)")


def prepare_scratch(start: StartPoint, scratch: Path) -> None:
    """Copy checkpoint K and the log up to and including its ``checkpoint_saved`` line."""
    scratch.mkdir(parents=True, exist_ok=True)
    shutil.copytree(start.checkpoint_path, scratch / "checkpoints" / start.checkpoint_path.name)
    with open(start.log, "rb") as src, open(scratch / LOG_NAME, "wb") as dst:
        for number, line in enumerate(src, start=1):
            dst.write(line)
            if number == start.checkpoint_line:
                break


def reproduce(
    start: StartPoint,
    scratch: Path,
    overrides: Sequence[str] = (),
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> Reproduction:
    """Re-run steps K+1..M in ``scratch`` (see the module docstring) and compare them with
    the original log. The config is checked before anything is copied or started."""
    from sft_runtime.runtime.checkpoint.resume import check_checkpoint
    from sft_runtime.runtime.launch.driver import run_training

    check_scratch(start.run_dir, scratch)
    config = reproduce_config(start, scratch, overrides)
    check_checkpoint(start.reader(), start.checkpoints, start.checkpoint)
    prepare_scratch(start, scratch)
    summary = run_training(config, on_step=on_step)
    diff = diff_runs(start.reader(), scratch / LOG_NAME, steps=start.steps)
    return Reproduction(start, scratch, diff, summary)

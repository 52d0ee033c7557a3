"""Checkpoint directories: written under a temporary name, fsynced, renamed, then kept or pruned.

Only ``step_<N>`` directories count as checkpoints; ``tmp_step_<N>`` is work in progress
that a crash may leave behind, and is removed on the next start. The rename is the commit
point, and `checkpoint_saved` is appended only after it, so the newest directory and the
newest record agree.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sft_runtime.events.log import fsync_dir
from sft_runtime.runtime.errors import UserInputError

INFO_NAME = "training_info.json"
LOADERS_NAME = "sft_v2_loaders.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^tmp_step_(\d+)$")


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory bottom-up."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def retained_steps(
    steps: Iterable[int],
    metrics: Mapping[int, float | None] | None,
    save_period: int,
    keep_top_k: int | None,
    ft_keep_latest_k: int | None,
    higher_is_better: bool,
) -> set[int]:
    """The checkpoints that survive pruning, by the NeMo RL reference's rules.

    Periodicity comes from the step number alone (``step % save_period == 0``), never from
    why a save happened, so the off-period saves a stop, a signal or the deadline makes do
    not pile up as if they were periodic. A null limit means "no limit" on its own set, but
    with both limits null nothing is pruned at all, so a default config never deletes
    anything. ``metrics`` without an entry (or None) for a step ranks that step worst, and
    equal metrics keep the newer step; with no metrics at all ``keep_top_k`` is by recency.
    """
    ordered = sorted(set(steps))
    if not ordered or (keep_top_k is None and ft_keep_latest_k is None):
        return set(ordered)
    keep = {ordered[-1]}
    periodic = [s for s in ordered if save_period > 0 and s % save_period == 0]
    if keep_top_k is None:
        keep.update(periodic)
    else:
        keep.update(_ranked(periodic, metrics or {}, higher_is_better)[: max(keep_top_k, 0)])
    if ft_keep_latest_k is not None:
        keep.update(ordered[::-1][: max(ft_keep_latest_k, 0)])
    return keep


def _ranked(
    steps: list[int], metrics: Mapping[int, float | None], higher_is_better: bool
) -> list[int]:
    """Best first; a step with no usable metric after every step with one, and between
    equals the newer first, so with no metrics this is newest first."""
    sign = -1.0 if higher_is_better else 1.0

    def key(step: int) -> tuple[int, float, int]:
        metric = metrics.get(step)
        if metric is None:
            return (1, 0.0, -step)
        return (0, sign * metric, -step)

    return sorted(steps, key=key)


def _usable_metric(info: Any) -> float | None:
    """A recorded metric that can be ranked; anything else (absent, null, NaN, not a
    number) counts as missing rather than failing the prune."""
    metric = info.get("metric") if isinstance(info, dict) else None
    if isinstance(metric, bool) or not isinstance(metric, int | float):
        return None
    metric = float(metric)
    return None if math.isnan(metric) else metric


class CheckpointDir:
    """``<checkpoint_dir>/step_<N>`` for one run, with retention rules."""

    def __init__(
        self,
        root: Path | str,
        *,
        save_period: int = 0,
        keep_top_k: int | None = None,
        ft_keep_latest_k: int | None = None,
        higher_is_better: bool = False,
    ) -> None:
        self.root = Path(root)
        self.save_period = save_period
        self.keep_top_k = keep_top_k
        self.ft_keep_latest_k = ft_keep_latest_k
        self.higher_is_better = higher_is_better

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def remove_stale(self) -> list[Path]:
        """Delete ``tmp_step_*`` left by a crash; they were never checkpoints."""
        removed = []
        if self.root.is_dir():
            for p in self.root.iterdir():
                if _TMP_DIR.match(p.name):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
        return removed

    def begin(self, step: int) -> Path:
        tmp = self.root / f"tmp_step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, step: int, tmp: Path, info: dict[str, Any]) -> Path:
        """Write training_info.json, fsync everything, rename into place (pruning is
        `prune`, after the checkpoint is recorded)."""
        (tmp / INFO_NAME).write_text(json.dumps(info, indent=2, sort_keys=True))
        fsync_tree(tmp)
        final = self.path(step)
        if final.exists():  # a re-run of a rolled-back step replaces the stale copy
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        return final

    def info(self, step: int) -> dict[str, Any]:
        path = self.path(step) / INFO_NAME
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise UserInputError(f"{path}: missing; the checkpoint is incomplete") from None
        except json.JSONDecodeError as exc:
            raise UserInputError(f"{path}: not valid JSON ({exc})") from None

    def prune(self) -> list[int]:
        """Delete what `retained_steps` does not keep; returns the removed steps.

        An unreadable training_info.json ranks its checkpoint worst instead of failing: a
        damaged old checkpoint must not stop a run that just saved a good one, and the
        newest is kept whatever its info says.
        """
        steps = self.steps()
        metrics = None
        if self.keep_top_k is not None:  # the only rule that reads the metric
            metrics = {step: self._metric(step) for step in steps}
        keep = retained_steps(
            steps,
            metrics,
            self.save_period,
            self.keep_top_k,
            self.ft_keep_latest_k,
            self.higher_is_better,
        )
        removed = [s for s in steps if s not in keep]
        for step in removed:
            shutil.rmtree(self.path(step), ignore_errors=True)
        return removed

    def _metric(self, step: int) -> float | None:
        try:
            return _usable_metric(self.info(step))
        except (UserInputError, OSError, UnicodeDecodeError):
            return None

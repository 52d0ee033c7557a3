"""Checkpoint directories: written under a temporary name, fsynced, renamed, then kept or pruned.

Only ``step_<N>`` directories count as checkpoints; ``tmp_step_<N>`` is work in progress
that a crash may leave behind, and is removed on the next start. The rename is the commit
point, and `checkpoint_saved` is appended only after it, so the newest directory and the
newest record agree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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


class CheckpointDir:
    """``<checkpoint_dir>/step_<N>`` for one run, with retention rules."""

    def __init__(
        self,
        root: Path | str,
        *,
        keep_top_k: int | None = None,
        ft_keep_latest_k: int = 1,
        higher_is_better: bool = False,
    ) -> None:
        self.root = Path(root)
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
        """Apply retention; the newest checkpoint is always kept. Returns removed steps."""
        steps = self.steps()
        if len(steps) <= 1:
            return []
        keep = {steps[-1]}
        periodic, ft_only = [], []
        for step in steps:
            info = self.info(step)
            kinds = set(info.get("kinds", ["periodic"]))
            if kinds - {"ft"}:
                periodic.append((step, info.get("metric")))
            else:
                ft_only.append(step)
        keep.update(ft_only[-self.ft_keep_latest_k :])
        if self.keep_top_k is None:
            keep.update(step for step, _ in periodic)
        else:
            keep.update(step for step, _ in self._best(periodic)[: self.keep_top_k])
        removed = [s for s in steps if s not in keep]
        for step in removed:
            shutil.rmtree(self.path(step), ignore_errors=True)
        return removed

    def _best(self, entries: list[tuple[int, float | None]]) -> list[tuple[int, float | None]]:
        """Best metric first; without a metric, newest first."""
        sign = -1.0 if self.higher_is_better else 1.0

        def key(entry: tuple[int, float | None]) -> tuple[int, float, int]:
            step, metric = entry
            if metric is None:
                return (1, 0.0, -step)
            return (0, sign * metric, -step)

        return sorted(entries, key=key)

"""The Weights & Biases backend (``logger.wandb_enabled``, NeMo RL's ``logger.wandb`` block).

These machines reach no W&B server, and a training run should never wait on one: unless
``WANDB_MODE`` says otherwise the run is written offline, to ``<run>/wandb/offline-run-*``,
and ``wandb sync <that folder>`` uploads it later (``wandb leet <that folder>`` shows it in a
terminal). wandb's banners are silenced unless ``WANDB_SILENT=false`` (they would interleave
with the progress display), and its console capture is off (the controller is a Ray actor
whose output Ray already forwards).

Each attempt of a run is its own W&B run: a resume from checkpoint K starts a new one at
step K + 1, as W&B cannot rewrite steps a run already logged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

WANDB_INSTALL = "pip install 'sft-runtime[wandb]'"

# run_stopped reasons that W&B should show as a failed run (exit code 1)
FAILED_REASONS = frozenset({"failed", "diverged"})
_FALSE = ("0", "false", "no", "off")


class WandbConfig(BaseModel):
    """NeMo RL's ``logger.wandb`` block, plus the `wandb.init` fields a team sorts runs by."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = None  # None: wandb's own default ("uncategorized")
    name: str | None = None  # None: wandb makes one up
    entity: str | None = None
    group: str | None = None
    tags: list[str] | None = None


class WandbWriter:
    """One W&B run: scalars at the run's global steps, finished with the attempt's outcome."""

    def __init__(
        self, config: WandbConfig, run_dir: Path, *, run_config: dict[str, Any] | None = None
    ) -> None:
        import wandb

        # read here, not left to wandb: it reads its variables once per process, at the
        # first run, and a process may open several (one per attempt)
        mode = os.environ.get("WANDB_MODE") or "offline"
        silent = os.environ.get("WANDB_SILENT", "true").lower() not in _FALSE
        self._run = wandb.init(
            project=config.project,
            name=config.name,
            entity=config.entity,
            group=config.group,
            tags=config.tags,
            config=run_config,
            dir=str(run_dir),
            mode=mode,
            # this run only: never finish or reuse a run the embedding program has open
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=silent),
        )

    @property
    def run_folder(self) -> Path:
        """The run's local folder (``.../wandb/offline-run-<time>-<id>``), what `wandb sync`
        takes."""
        return Path(self._run.dir).parent

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self, reason: str = "completed") -> None:
        self._run.finish(exit_code=1 if reason in FAILED_REASONS else 0)

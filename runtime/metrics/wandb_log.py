"""The Weights & Biases backend (``logger.wandb_enabled``, NeMo RL's ``logger.wandb`` block).

These machines reach no W&B server, and a training run should never wait on one: unless
``WANDB_MODE`` says otherwise the run is written offline, to ``<run>/wandb/offline-run-*``,
and ``wandb sync <that folder>`` uploads it later (``wandb leet <that folder>`` shows it in a
terminal). wandb's banners are silenced unless ``WANDB_SILENT=false`` (they would interleave
with the progress display), and its console capture is off (the controller is a Ray actor
whose output Ray already forwards).

Each attempt of a run is its own W&B run: a resume from checkpoint K starts a new one at
step K + 1, as W&B cannot rewrite steps a run already logged.

wandb leaves part of its cleanup to the process's exit hooks: its service's socket folder
and two temporary folders it makes when imported, all in the temporary directory. The
controller's process never runs them (a Ray actor ends by `ray.kill`), so there the writer
is told (``killed_at_end``) and does that cleanup itself when it closes; every run would
otherwise leave three folders in ``/tmp``.
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
        self,
        config: WandbConfig,
        run_dir: Path,
        *,
        run_config: dict[str, Any] | None = None,
        killed_at_end: bool = False,
    ) -> None:
        import wandb

        self._killed_at_end = killed_at_end

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
        if self._killed_at_end:
            release_wandb()


def release_wandb() -> None:
    """What wandb's exit hooks do, for a process that will be killed: stop the service this
    process started (it removes its socket folder) and remove the temporary folders wandb
    made when imported. Only for a process wandb is not otherwise used in: the service's
    stop finishes any run still open in it."""
    import wandb
    from wandb.sdk.artifacts.artifact import Artifact
    from wandb.sdk.data_types import _private

    wandb.teardown()
    for folder in (_private.MEDIA_TMP, Artifact._TMP_DIR):
        folder.cleanup()

"""`sft-runtime events RUN_DIR --plot FILE.png`: a run's story from its log, as one figure.

Loss, learning rate and tokens/s over steps, one colour per attempt, with what a resume
did drawn on top: where each attempt started, the steps it executed again (committed by an
earlier attempt, then rolled back and re-run), the steps it rolled back, aborted steps and
checkpoints. Everything comes from ``events.jsonl``; tokens/s is the step's valid tokens
over its ``total_step_time``, the same formula as ``valid_tokens_per_second`` in
metrics.jsonl. matplotlib is an optional extra, imported only here and only for ``--plot``.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sft_runtime.events import Record
from sft_runtime.events.lineage import resume_limits
from sft_runtime.events.schemas import as_float
from sft_runtime.runtime.errors import UserInputError

PLOT_INSTALL = "pip install 'sft-runtime[plot]'"
_MARKERS_UP_TO = 300  # steps per attempt drawn with a marker on every point


@dataclass
class AttemptSeries:
    """What one attempt committed, step by step, and what happened around it."""

    number: int
    resumed_from_step: int | None = None
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    reexecuted: list[int] = field(default_factory=list)  # committed before by an earlier attempt
    rolled_back: list[int] = field(default_factory=list)  # discarded by a later resume
    aborts: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)  # validation passes, after these steps
    val_loss: list[float] = field(default_factory=list)
    workers: int | None = None  # set when it trained on another number than the run before

    @property
    def start(self) -> int:
        """The step this attempt began after (0 for a fresh run)."""
        return self.resumed_from_step or 0


def collect(records: Iterable[Record]) -> list[AttemptSeries]:
    """The per-attempt series of a log, in attempt order (a pure function of the records).

    ``records`` is iterated twice (first for the resume points), so pass a list or a
    `LogReader`, which rereads its file.
    """
    limits = resume_limits(records)
    attempts: dict[int, AttemptSeries] = {}
    committed_by: dict[int, int] = {}  # step -> the attempt that first committed it
    for rec in records:
        att = attempts.setdefault(rec.attempt, AttemptSeries(rec.attempt))
        data = rec.data
        if rec.type == "run_started":
            att.resumed_from_step = data.get("resumed_from_step")
        elif rec.type == "step_committed":
            step = data["step"]
            att.steps.append(step)
            att.loss.append(as_float(data["loss"]))
            att.lr.append(as_float(data["lr"]))
            att.tokens_per_s.append(_tokens_per_second(data))
            if committed_by.setdefault(step, rec.attempt) != rec.attempt:
                att.reexecuted.append(step)
            if step > limits.get(rec.attempt, math.inf):
                att.rolled_back.append(step)
        elif rec.type == "validation_completed":
            att.val_steps.append(data["step"])
            att.val_loss.append(as_float(data["loss"]))
        elif rec.type == "step_aborted":
            att.aborts.append(data["step"])
        elif rec.type == "checkpoint_saved":
            att.checkpoints.append(data["step"])
        elif rec.type == "placement_changed":
            att.workers = data["new_world_size"]
    return [attempts[n] for n in sorted(attempts)]


def _tokens_per_second(data: dict[str, Any]) -> float:
    seconds = data.get("timings", {}).get("total_step_time", 0.0)
    return data["valid_tokens"] / seconds if seconds > 0 else math.nan


def require_matplotlib() -> None:
    """Refuse ``--plot`` up front (exit 2, one line) when the extra is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserInputError(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}")


def check_output(path: Path) -> None:
    """The figure is a PNG written next to where it will live; both must make sense."""
    if path.suffix.lower() != ".png":
        raise UserInputError(f"--plot {path}: the figure is a PNG, name it FILE.png")
    if not path.parent.is_dir():
        raise UserInputError(f"--plot {path}: no such directory {path.parent}")


def draw(series: list[AttemptSeries], title: str) -> Any:
    """A matplotlib `Figure` (Agg canvas, no pyplot: no global state, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    panels = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))
    colours = [f"C{i % 10}" for i in range(len(series))]
    for ax, (attr, label) in zip(axes, panels, strict=True):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        for att, colour in zip(series, colours, strict=True):
            _draw_attempt(ax, att, getattr(att, attr), colour)
        _draw_marks(ax, series)
    for att, colour in zip(series, colours, strict=True):  # validation beside the train loss
        if att.val_steps:
            axes[0].plot(
                att.val_steps,
                att.val_loss,
                color=colour,
                linestyle="--",
                marker="s",
                markersize=5,
                label="validation loss",
            )
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    for att, colour in zip(series, colours, strict=True):
        text = f"attempt {att.number}"
        if att.resumed_from_step is not None:
            text += f" (resumed from {att.resumed_from_step})"
        axes[0].text(
            att.start + 0.5,
            1.0,
            text,
            transform=axes[0].get_xaxis_transform(),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=colour,
        )
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    axes[0].legend(unique.values(), unique.keys(), fontsize=8, loc="upper right")
    fig.suptitle(title)
    return fig


def _draw_attempt(ax: Any, att: AttemptSeries, values: list[float], colour: str) -> None:
    label = f"attempt {att.number}"
    marker = "." if len(att.steps) <= _MARKERS_UP_TO else None
    ax.plot(att.steps, values, color=colour, marker=marker, linewidth=1.2, label=label)
    at = dict(zip(att.steps, values, strict=True))
    if att.reexecuted:
        ax.plot(
            att.reexecuted,
            [at[s] for s in att.reexecuted],
            linestyle="none",
            marker="D",
            markersize=6,
            markerfacecolor=colour,
            markeredgecolor="black",
            label="re-executed after a resume",
        )
    if att.rolled_back:
        ax.plot(
            att.rolled_back,
            [at[s] for s in att.rolled_back],
            linestyle="none",
            marker="o",
            markersize=11,  # rings the diamond of the step's re-execution
            markerfacecolor="none",
            markeredgecolor=colour,
            label="rolled back by a resume",
        )
    # the attempt's start: a resume point, or step 0 of a fresh run
    ax.axvline(att.start + 0.5, color=colour, linestyle="-.", linewidth=1.0, alpha=0.8)
    if att.workers is not None:  # a resume on another number of workers: say how many
        top = ax.get_xaxis_transform()
        ax.text(att.start + 0.5, 0.97, f" W={att.workers}", transform=top, va="top", fontsize=8)


def _draw_marks(ax: Any, series: list[AttemptSeries]) -> None:
    """Checkpoints (dotted lines) and aborts (x at the foot of the axes), every attempt."""
    saved = sorted({step for att in series for step in att.checkpoints})
    for i, step in enumerate(saved):
        ax.axvline(
            step,
            color="grey",
            linestyle=":",
            linewidth=1.2,
            label="checkpoint" if i == 0 else None,
        )
    foot = ax.get_xaxis_transform()  # x in steps, y in axes fractions
    for att in series:
        if att.aborts:
            ax.plot(
                att.aborts,
                [0.04] * len(att.aborts),
                transform=foot,
                linestyle="none",
                marker="x",
                markersize=9,
                markeredgewidth=2,
                color="red",
                label="aborted step",
            )


def write_plot(records: Iterable[Record], path: Path, *, title: str) -> Path:
    """Draw the run and write the PNG atomically: a temporary name, then a rename, so a
    reader (or a crash) never sees half a file."""
    fig = draw(collect(records), title)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path

"""`sft-runtime train CONFIG [key=value ...]` and `sft-runtime demo`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from sft_runtime.runtime.errors import DiskFullError, UserInputError

EXIT_INTERRUPTED = 130
# The per-step sample counts the progress line shows once they are not zero.
SAMPLE_NOTES = {"overlong_samples": "overlong", "skipped_samples": "skipped"}
OVERLONG_OUTCOME = {
    "mask": "cut to the limit and trained with zero weight",
    "truncate": "cut to the limit, the tokens that remain trained",
    "drop": "left out of their batches",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train from a YAML config (resumes when the run dir has one)")
    p.add_argument("config", nargs="?", default=None, help="the config file (or --config FILE)")
    p.add_argument(
        "overrides",
        nargs="*",
        help="Hydra-style overrides: a.b=value, +a.b=value (add), ++a.b=value (add or set), "
        "~a.b (remove)",
    )
    p.add_argument("--config", dest="config_option", type=Path, default=None, metavar="FILE")
    p.add_argument("--run-dir", type=Path, default=None, help="sets logger.log_dir")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even though keys that decide a step changed since the checkpoint "
        "(checkpointing.allow_config_change=true); run_started records them",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "demo",
        help="fine-tune a real chat model (SmolLM2-135M-Instruct, LoRA) end to end in minutes; "
        "--toy: a tiny model on synthetic chats",
    )
    p.add_argument(
        "--run-dir", type=Path, default=None, help="default runs/demo-smollm2 (--toy: runs/demo)"
    )
    p.add_argument("--steps", type=int, default=None, help="default 12 (--toy: 150)")
    p.add_argument(
        "--toy", action="store_true", help="the quick look: a tiny model built here, no download"
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the converted model is kept (default ~/.cache/sft-runtime/"
        "SmolLM2-135M-Instruct; see fetch-demo-model)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_train(args: argparse.Namespace) -> int:
    from sft_runtime.runtime.config import load_config
    from sft_runtime.runtime.launch.run_dirs import check_dir_to_create

    path, overrides = _config_and_overrides(args)
    if args.run_dir is not None:
        overrides.append(f"logger.log_dir={args.run_dir}")
    if args.allow_config_change:
        overrides.append("checkpointing.allow_config_change=true")
    config = load_config(path, overrides)
    if config.logger.log_dir is None:
        raise UserInputError("logger.log_dir: required (or pass --run-dir DIR)")
    check_dir_to_create(
        config.logger.log_dir, "logger.log_dir" if args.run_dir is None else "--run-dir"
    )
    return _train(config)


def _config_and_overrides(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The config file, given as the first argument or as ``--config FILE`` (as NeMo RL's
    scripts take it), and the overrides after it."""
    overrides = list(args.overrides)
    if args.config_option is None:
        if args.config is None:
            raise UserInputError("train: a config file is required (CONFIG or --config FILE)")
        return Path(args.config), overrides
    if args.config is not None:
        if not is_override(args.config):
            raise UserInputError(
                f"train: two config files ({args.config} and --config {args.config_option}); "
                "give one"
            )
        overrides.insert(0, args.config)
    return args.config_option, overrides


def is_override(item: str) -> bool:
    """A Hydra-style override (``a.b=v``, ``+a.b=v``, ``++a.b=v``, ``~a.b``), not an option."""
    return item.startswith("~") or ("=" in item and not item.startswith("-"))


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from sft_runtime.runtime.cli.demo import demo_config, greedy_completions
    from sft_runtime.runtime.data.demo import build_demo_dataset

    if args.steps is not None and args.steps < 1:
        raise UserInputError(f"--steps must be >= 1, got {args.steps}")
    if not args.toy:
        from sft_runtime.runtime.cli.demo_pretrained import run_pretrained_demo

        return run_pretrained_demo(args, _train, _demo_budget)
    args.run_dir = args.run_dir or Path("runs/demo")
    args.steps = args.steps or 150
    from sft_runtime.runtime.launch.run_dirs import check_dir_to_create

    check_dir_to_create(args.run_dir, "--run-dir")
    console = Console()
    data_dir = args.run_dir / "data"
    if not (data_dir / ".nv-meta").is_dir():
        console.print(f"building the synthetic chat data set in {data_dir} ...")
        build_demo_dataset(data_dir, num_samples=1024, seed=0)
    config = demo_config(args.run_dir, data_dir, _demo_budget(args.run_dir, args.steps))
    before = greedy_completions(config, None)
    code = _train(config, console=console)
    from sft_runtime.runtime.checkpoint.store import CheckpointDir
    from sft_runtime.runtime.config import checkpoint_root

    steps = CheckpointDir(checkpoint_root(config)).steps()
    if steps:
        weights = checkpoint_root(config) / f"step_{steps[-1]}" / "policy" / "weights"
        after = greedy_completions(config, weights)
        from sft_runtime.runtime.cli.demo import DEMO_PROMPTS

        console.print("sample completions (before -> after):")
        for prompt, b, a in zip(DEMO_PROMPTS, before, after, strict=True):
            console.print(f"  {prompt!r}: {b!r} -> {a!r}", markup=False)
    return code


def _train(config, console=None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sft_runtime.runtime.config import _max_train_steps, checkpoint_root
    from sft_runtime.runtime.data.bring import bring_data
    from sft_runtime.runtime.launch.driver import RunInterrupted, run_training

    console = console or Console()
    config = bring_data(config)  # NeMo RL's data files prepared (once), the epoch known
    run_dir = Path(config.logger.log_dir)
    total = _max_train_steps(config)
    progress = Progress(
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    task = progress.add_task("train", total=total, info="")
    seen = dict.fromkeys([*SAMPLE_NOTES, "nonfinite_skipped"], 0)

    shown = {"train": "", "val": ""}

    def on_step(row: dict) -> None:
        if not progress.live.is_started:
            progress.start()
        if "val" in row:  # a validation pass: shown beside the steps until the next one
            shown["val"] = (
                f"  val_loss {_number(row['val'].get('val_loss')):.4f} (step {row['step']})"
            )
        else:
            m = row.get("train", {})
            info = (
                f"loss {_number(m.get('loss')):.4f}  "
                f"{_number(m.get('valid_tokens_per_second')):,.0f} tok/s"
            )
            seen["nonfinite_skipped"] += int(m.get("nonfinite_skipped", 0))
            if seen["nonfinite_skipped"]:
                info += f"  {seen['nonfinite_skipped']} non-finite skipped"
            for key, what in SAMPLE_NOTES.items():
                seen[key] += int(m.get(key, 0))
                if seen[key]:
                    info += f"  {seen[key]} {what}"
            shown["train"] = info
        progress.update(task, completed=row["step"], info=shown["train"] + shown["val"])

    def on_stop() -> None:
        console.print("stop requested: finishing the step and saving (signal again to abort)")

    saved_in = checkpoint_root(config)  # checkpointing.checkpoint_dir, or RUN_DIR/checkpoints
    from sft_runtime.runtime.policy.param_count import count_parameters

    console.print(count_parameters(config.policy).describe())
    console.print(f"starting Ray and {config.cluster.world_size} workers for {run_dir} ...")
    try:
        summary = run_training(config, on_step=on_step, on_stop_request=on_stop)
    except RunInterrupted as exc:
        progress.stop()
        _report(console, exc.summary, run_dir, config.data.overlong_samples, saved_in)
        return EXIT_INTERRUPTED
    except Exception as exc:
        full = _disk_full(exc, config)
        if full is None:
            raise
        raise full from None  # one line (`main`), not the traceback of every wrapper
    finally:
        progress.stop()
    _report(console, summary, run_dir, config.data.overlong_samples, saved_in)
    return 0


def _disk_full(exc: Exception, config) -> DiskFullError | None:
    """A failure a full disk caused, naming the step the same command resumes from (the
    newest complete checkpoint: a write that failed left none half-done), else None."""
    from sft_runtime.runtime.checkpoint.store import CheckpointDir
    from sft_runtime.runtime.config import checkpoint_root
    from sft_runtime.runtime.process.disk_full import disk_full_error

    full = disk_full_error(exc, where=config.logger.log_dir)
    if full is None or full.resume_step is not None:
        return full
    saved = CheckpointDir(checkpoint_root(config)).steps()
    return DiskFullError(full.errno, full.what, saved[-1] if saved else 0)


def _report(
    console,
    summary: dict | None,
    run_dir: Path,
    overlong_policy: str = "mask",
    saved_in: Path | None = None,
) -> None:
    """The run's end: what it did, and where its events, metrics, checkpoints (``saved_in``,
    default RUN_DIR/checkpoints) and traces are."""
    if summary is None:
        return
    if summary["resumed_from_step"]:
        console.print(
            f"resumed from step {summary['resumed_from_step']} (attempt {summary['attempt']})"
        )
    if summary["steps_run"] == 0 and summary["reason"] == "completed":
        console.print(
            f"the budget of {summary['max_steps']} steps was already reached: nothing to train"
        )
    elif summary["first_loss"] is not None:
        console.print(
            f"{summary['reason']}: {summary['steps_run']} steps, loss "
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, "
            f"{summary['total_steps']}/{summary['max_steps']} steps done"
        )
    if summary.get("overlong_samples"):
        console.print(
            f"{summary['overlong_samples']} sample(s) longer than data.max_input_seq_length: "
            f"{OVERLONG_OUTCOME[overlong_policy]} (data.overlong_samples={overlong_policy})"
        )
    if summary.get("nonfinite_skipped"):
        console.print(
            f"{summary['nonfinite_skipped']} step(s) with a non-finite loss or gradient norm were "
            "committed without their update (sft.skip_nonfinite_steps=true)"
        )
    if summary.get("skipped_samples"):
        console.print(
            f"{summary['skipped_samples']} sample(s) refused by the chat template were skipped "
            "(data.skip_bad_samples=true)"
        )
    console.print(f"events:      {run_dir / 'events.jsonl'}  (sft-runtime events {run_dir})")
    console.print(f"metrics:     {run_dir / 'metrics.jsonl'}")
    saved_in = saved_in or run_dir / "checkpoints"
    console.print(f"checkpoints: {summary['checkpoints']} under {saved_in}")
    merged = sorted((run_dir / "traces").glob("run-attempt*.json"))
    if merged:
        console.print(f"traces:      {merged[-1]}  (Jaeger UI: Search -> Upload; or")
        console.print(f"             sft-runtime trace {run_dir} --step N)")
    else:
        console.print("traces:      off (set telemetry.enabled=true)")


def _demo_budget(run_dir: Path, steps: int) -> int:
    """A finished demo run trains ``steps`` more when run again; an interrupted one resumes
    to its budget."""
    from sft_runtime.events import history, read_log
    from sft_runtime.events.log import log_path
    from sft_runtime.states import replay

    if not log_path(run_dir).is_file():
        return steps
    attempts = history(read_log(run_dir)).attempts
    done = replay(run_dir).total_steps
    finished = bool(attempts) and attempts[-1].stop_reason == "completed"
    return done + steps if finished else max(steps, done)


def _number(value: float | None) -> float:
    """A metric as the progress line shows it: JSON writes a non-finite value as null."""
    return math.nan if value is None else float(value)

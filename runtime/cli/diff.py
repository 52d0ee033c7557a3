"""`diff RUN_A RUN_B`: the config keys that differ, then where the two runs part ways.

Configs come from each run's newest checkpoint (``config.yaml``, what the run trained with);
steps from the logs (`events.run_diff`). Exit 0 when the runs are identical step for step
(samples, losses, grad norms and learning rates bitwise), 1 when they differ (the first step
that differs in anything is named, with what differs), 2 when a run cannot be read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from sft_runtime.runtime.errors import UserInputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="config differences and the first step where two runs part")
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_diff)


def dotted_diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) wherever two nested mappings differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            out.extend(dotted_diff(a.get(key, _MISSING), b.get(key, _MISSING), name))
        return out
    return [] if a == b else [(prefix, a, b)]


_MISSING = "<absent>"


def run_config(run_dir: Path) -> dict | None:
    """The config of the run's newest checkpoint, in the folder the log records its
    checkpoints in (None when it holds none)."""
    from sft_runtime.runtime.checkpoint.recorded import checkpoint_store

    store = checkpoint_store(run_dir)
    steps = store.steps()
    if not steps:
        return None
    path = store.path(steps[-1]) / "config.yaml"
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError(f"{path}: unreadable ({exc})") from None


def cmd_diff(args: argparse.Namespace) -> int:
    from sft_runtime.events.run_diff import diff_runs
    from sft_runtime.runtime.cli.inspect import _reader

    readers = [_reader(args.run_a), _reader(args.run_b)]
    configs = [run_config(args.run_a), run_config(args.run_b)]
    changed = [] if None in configs else dotted_diff(*configs)
    result = diff_runs(*readers)
    resumes = [changed_attempts(reader) for reader in readers]
    if args.json:
        shown = _as_json(changed, configs, result)
        shown["changed_resumes"] = {"a": resumes[0], "b": resumes[1]}
        print(json.dumps(shown, sort_keys=True))
    else:
        for label, attempts in zip("AB", resumes, strict=True):
            _print_resumes(label, attempts)
        _print(changed, configs, result)
    return 0 if result.identical else 1


def changed_attempts(reader: Any) -> list[dict[str, Any]]:
    """The attempts of a run that resumed with a changed config or a fresh optimizer (from
    their run_started): within one run, where its steps stop matching what came before."""
    from sft_runtime.events import history

    return [
        {
            "attempt": att.number,
            "resumed_from_step": att.resumed_from_step,
            "config_digest": att.config_digest,
            "config_changes": att.config_changes,
            "optimizer_restored": att.optimizer_restored,
        }
        for att in history(reader).attempts
        if att.config_changes or att.optimizer_restored is False
    ]


def _print_resumes(label: str, attempts: list[dict[str, Any]]) -> None:
    for att in attempts:
        changes = "; ".join(
            f"{key}: {json.dumps(old)} -> {json.dumps(new)}"
            for key, (old, new) in att["config_changes"].items()
        )
        fresh = "" if att["optimizer_restored"] is not False else " AdamW started fresh."
        print(
            f"run {label}: attempt {att['attempt']} resumed from step "
            f"{att['resumed_from_step']}" + (f" with {changes}." if changes else ".") + fresh
        )


def _as_json(changed, configs, result) -> dict:
    def first(diff):
        return None if diff is None else {"step": diff.step, "loss_delta": diff.loss_delta}

    return {
        "config": None if None in configs else [list(c) for c in changed],
        "steps": [
            {
                "step": s.step,
                "in_a": s.a is not None,
                "in_b": s.b is not None,
                "samples_agree": s.samples_agree,
                "loss_a": None if s.a is None else s.a.loss,
                "loss_b": None if s.b is None else s.b.loss,
            }
            for s in result.steps
        ],
        "first_sample_difference": first(result.first_sample_difference),
        "first_loss_difference": first(result.first_loss_difference),
        "first_difference": None
        if result.first_difference is None
        else {
            "step": result.first_difference.step,
            "what": [d[0] for d in result.first_difference.differences()],
        },
        "identical": result.identical,
    }


def _print(changed, configs, result) -> None:
    if None in configs:
        print("config: not compared (a run has no checkpoint, so no recorded config)")
    elif not changed:
        print("config: identical")
    else:
        print("config differences:")
        for key, a, b in changed:
            print(f"  {key}: {a!r} -> {b!r}")
    print(f"{'step':>6}  {'samples':<8} {'loss A':>14} {'loss B':>14} {'delta':>11}")
    for s in result.steps:
        agree = {True: "same", False: "DIFFER", None: "-"}[s.samples_agree]
        loss_a = "-" if s.a is None else f"{s.a.loss:.8g}"
        loss_b = "-" if s.b is None else f"{s.b.loss:.8g}"
        delta = "-" if s.loss_delta is None else f"{s.loss_delta:+.3g}"
        print(f"{s.step:>6}  {agree:<8} {loss_a:>14} {loss_b:>14} {delta:>11}")
    samples, loss = result.first_sample_difference, result.first_loss_difference
    print("first step whose samples differ: " + ("none" if samples is None else str(samples.step)))
    if loss is None:
        print("first step whose loss differs: none")
    else:
        rel = abs(loss.loss_delta) / max(abs(loss.a.loss), 1e-30)
        print(
            f"first step whose loss differs: {loss.step} "
            f"(by {loss.loss_delta:+.6g}, {rel:.3g} relative)"
        )
    first = result.first_difference
    if first is not None:
        what = ", ".join(f"{name} {a!r} -> {b!r}" for name, a, b in first.differences())
        print(f"first step that differs in anything: {first.step} ({what})")
    print("identical" if result.identical else "the runs differ")

"""`reproduce RUN_DIR --step N [--to M] [key=value ...]`: re-run steps, compare bit for bit.

Steps from the newest checkpoint K before N through N (or M) are executed again on the
current code in a scratch directory (`runtime.debug.reproduce`; RUN_DIR is only read), then
each step's samples, loss, grad norm and learning rate are compared with the log. Exit 0
when every step is identical, 1 at the first divergence (the table and the first divergent
step say what differs), 2 for bad input (no checkpoint before N, N beyond the log, a
damaged log, a config that no longer validates), 130 when interrupted (Ctrl-C or SIGTERM;
the scratch directory's copy of the checkpoint is removed either way, unless ``--scratch``
named it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

EXIT_INTERRUPTED = 130


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reproduce", help="re-execute steps on the current code and compare")
    p.add_argument("run_dir", type=Path)
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the run's config")
    p.add_argument("--step", type=int, required=True, help="the first step of interest")
    p.add_argument("--to", type=int, default=None, help="re-run through this step (default N)")
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="look for the checkpoints here (default: where the log records them)",
    )
    p.add_argument(
        "--scratch", type=Path, default=None, help="an empty directory to re-run in, kept after"
    )
    p.set_defaults(func=cmd_reproduce)


def cmd_reproduce(args: argparse.Namespace) -> int:
    from sft_runtime.runtime.debug.reproduce import reproduce
    from sft_runtime.runtime.debug.start import find_start
    from sft_runtime.runtime.launch.driver import RunInterrupted
    from sft_runtime.runtime.process.terminate import sigterm_interrupts

    start = find_start(args.run_dir, args.step, until=args.to, checkpoint_dir=args.checkpoint_dir)
    # the scratch copy of the checkpoint is removed however the command ends: SIGTERM too
    with sigterm_interrupts(), tempfile.TemporaryDirectory(prefix="sft-reproduce-") as tmp:
        scratch = args.scratch or Path(tmp) / "run"
        print(
            f"re-executing steps {start.checkpoint + 1}..{start.until} of {start.run_dir} from "
            f"{start.checkpoint_path} in {scratch}",
            flush=True,
        )
        try:
            result = reproduce(start, scratch, args.overrides)
        except RunInterrupted:
            print("sft-runtime reproduce: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    _print(result.diff)
    return 0 if result.diff.identical else 1


def _num(value: float | None) -> str:
    return "-" if value is None else repr(value)  # the shortest text that is the same float


def _print(diff) -> None:
    cols = ("step", "samples", "loss (log)", "loss (now)", "grad norm (log)", "grad norm (now)")
    print(f"{cols[0]:>6}  {cols[1]:<8}" + "".join(f" {c:>20}" for c in cols[2:]) + "  differs")
    for s in diff.steps:
        agree = {True: "same", False: "DIFFER", None: "-"}[s.samples_agree]
        a, b = s.a, s.b
        values = (a and a.loss, b and b.loss, a and a.grad_norm, b and b.grad_norm)
        differs = ", ".join(name for name, _, _ in s.differences()) or "-"
        print(
            f"{s.step:>6}  {agree:<8}" + "".join(f" {_num(v):>20}" for v in values) + f"  {differs}"
        )
    first = diff.first_difference
    if first is None:
        steps = f"{diff.steps[0].step}..{diff.steps[-1].step}"
        print(f"identical: steps {steps} reproduce bit for bit (samples, loss, grad norm, lr)")
        return
    print(f"first divergent step: {first.step}: " + "; ".join(_describe(first)))


def _describe(step) -> list[str]:
    out = []
    for name, was, now in step.differences():
        if name == "step":
            out.append("missing from the re-execution" if was else "not in the original log")
        elif name == "samples":
            out.append(f"samples differ on logical ranks {list(step.differing_ranks)}")
        elif was is None or now is None:
            out.append(f"{name} {was!r} -> {now!r}")
        else:
            out.append(f"{name} {was!r} -> {now!r} ({now - was:+.3g})")
    return out

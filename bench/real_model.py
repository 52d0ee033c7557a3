"""A real pretrained model at DP=1: sft-runtime's worker against a plain transformers loop and
TRL's SFTTrainer, on the same conversations (bench/real_model_sides.py has the three).

The model is SmolLM2-135M-Instruct (`sft-runtime fetch-demo-model`, into the user's cache)
and the conversations the demo's identity chats, rendered by SmolLM2's template (TRL and the
plain loop get its ``{% generation %}`` variant, tests/support/smollm2_template.py, for
their assistant masks). Three modes: a full fine-tune unpacked (16 conversations a step in
micro-batches of 4) and packed (4 rows of up to 256 tokens a step, 2 a micro-batch; TRL's
``packing=True``; sft-runtime's global batch counts conversations, so it gets as many a step
as 4 packed rows hold on average, `conversations_per_step`), and LoRA (dim 16, every linear
layer, unpacked) against TRL with peft.
Same lr, rows, micro-batches, max length, assistant-only loss, AdamW at a constant LR,
clipping at 1.0, float32 (TRL's bf16 and activation-checkpointing defaults turned off).

The three sides of a mode train at once, each in a fresh process, and take turns a step at a
time (plain, runtime, TRL, then TRL, runtime, plain, ...; `_in_turns`), so only one computes
at any moment and a busy spell of the machine weighs on all of them; a ratio is the median
of three rounds' (each round three fresh processes, since processes of the same program
differ by a few percent here), and each side opens one round of the three (the side that
opens and the side that closes go twice in a row at every reversal). Figures: supervised
tokens per second over the steps after the warm-up, and the process's peak RSS. Targets:
sft-runtime's time per supervised token <= 1.05x the plain loop's (its step time on the same
tokens), its tokens/s >= 1.0x TRL's in every mode. Where one is missed, rows say where the
time went (getting the batch, forward/backward, the optimizer step) and how many positions
the forward passes ran over for each real one.

Smoke mode runs the same code on a tiny Qwen2 model built here (no download), 3 steps, each
side's modes one after another in one child process, the three children taking turns.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench import zygote  # noqa: E402
from bench.real_model_sides import TURNS_ENV, Setup, run_side  # noqa: E402
from bench.table import Row  # noqa: E402
from sft_runtime.runtime.process.heap import worker_heap_env  # noqa: E402

STEPS = h.pick(6, 3)
# rounds of fresh processes: two processes of the same program differ by a few percent here,
# so a ratio is the median of three rounds' (one odd process pair cannot move it)
ROUNDS = h.pick(3, 1)
WARMUP = h.pick(2, 1)
SEQ = 256
MODES: dict[str, dict[str, Any]] = {
    "unpacked": {"rows": 16, "micro": 4, "lr": 1e-4, "packed": False, "lora": None},
    "packed": {"rows": 4, "micro": 2, "lr": 1e-4, "packed": True, "lora": None},
    "lora": {
        "rows": 16,
        "micro": 4,
        "lr": 1e-3,
        "packed": False,
        # every linear layer but the LM head (TRL refuses an adapter there; SmolLM2's is
        # tied to the embedding, which the runtime leaves out anyway)
        "lora": {"dim": 16, "alpha": 32, "match_all_linear": True, "exclude_modules": ["lm_head"]},
    },
}
SIDES = ("plain", "runtime", "trl")
STEP_TARGET = 1.05  # sft-runtime's time per supervised token over the plain loop's
TRL_TARGET = 1.0  # sft-runtime's tokens/s over TRL's
# torch threads of a side: the machine's cores (smoke: one; `h.SMOKE_THREADS_ENV` says why)
THREADS = h.pick(h.usable_cores(), 1)
MARK = "real-model-side: "  # a child's result line (TRL prints its logs to stdout too)
# Full: each run of a side in a fresh process, so that its peak RSS and its imports are its
# own. Smoke: one process per side runs its every mode in turn (smoke figures mean nothing).
FRESH_PROCESS_PER_RUN = not h.SMOKE


def _model(scratch: Path) -> tuple[Path, str | None]:
    """(model folder, its template with generation markers; None: its own has them)."""
    if h.SMOKE:
        from sft_runtime.runtime.data.identity_chats import identity_conversations
        from tests.support.hf_models import hf_model_dir

        texts = ["\n".join(m["content"] for m in c) for c in identity_conversations(200, seed=9)]
        return hf_model_dir(scratch / "tiny-qwen2", family="qwen2", texts=texts), None
    from sft_runtime.runtime.models.demo_model import fetch_demo_model
    from tests.support.smollm2_template import GENERATION_TEMPLATE

    return fetch_demo_model(progress=lambda line: print(line, file=sys.stderr)), (
        GENERATION_TEMPLATE
    )


def _data(scratch: Path, model: Path, count: int) -> tuple[Path, Path]:
    """The conversations as JSONL and prepared for the runtime (rendered by the template)."""
    from sft_runtime.runtime.data.identity_chats import write_identity_jsonl
    from sft_runtime.runtime.data.prepare import prepare_jsonl

    chats = write_identity_jsonl(scratch / "chats.jsonl", count, seed=1)
    prepare_jsonl(chats, scratch / "data", shard_size=256, tokenizer=model)
    return chats, scratch / "data"


class _Child:
    """A child process running (side, setup file, work folder) jobs in turn, and the pipes by
    which it is handed its turns (bench/real_model_sides.py's `Turns`)."""

    def __init__(self, jobs: list[tuple[str, Path, Path]]) -> None:
        argv = []
        for side, setup_file, work in jobs:
            work.mkdir(parents=True, exist_ok=True)
            argv += [side, str(setup_file), str(work)]
        go_read, self._go = os.pipe()
        self._ready, ready_write = os.pipe()
        # the runtime's side starts as a policy worker does (runtime/process/heap.py)
        heap = worker_heap_env() if {side for side, *_ in jobs} == {"runtime"} else {}
        # a file, not a pipe: a child must never block on its output while it waits its turn
        self._out = tempfile.TemporaryFile("w+", encoding="utf-8")
        self._proc = zygote.Popen(
            [sys.executable, __file__, "--child", *argv],
            stdout=self._out,
            env={**os.environ, **heap, TURNS_ENV: f"{go_read},{ready_write}"},
            pass_fds=(go_read, ready_write),
        )
        os.close(go_read)
        os.close(ready_write)
        self.waiting = False  # blocked until handed a turn

    def wait_ready(self) -> None:
        """Block until the child waits for its turn or has ended."""
        self.waiting = os.read(self._ready, 1) == b"r"

    def turn(self) -> None:
        """Let the child run until it waits again: one step, or its end of a job."""
        os.write(self._go, b"g")
        self.wait_ready()

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def results(self) -> list[dict[str, Any]]:
        code = self._proc.wait()
        os.close(self._go)
        os.close(self._ready)
        self._out.seek(0)
        lines = self._out.read().splitlines()
        self._out.close()
        if code:
            raise subprocess.CalledProcessError(code, self._proc.args)
        return [json.loads(line[len(MARK) :]) for line in lines if line.startswith(MARK)]


def _in_turns(
    groups: list[list[tuple[str, Path, Path]]], first: int = 0
) -> list[list[dict[str, Any]]]:
    """Each group's jobs in a child of its own, the children up at once and taking turns,
    in an order that reverses every round so that a trend in the machine's speed falls on
    every side alike; each child's results. ``first``: the group that goes first. The ends
    of the order go twice in a row at every reversal and the middle never does, so the
    rounds of a mode give each side the first place in turn."""
    children = [_Child(jobs) for jobs in groups]
    try:
        for child in children:  # they load their models at once
            child.wait_ready()
        round_ = 0
        rotated = children[first:] + children[:first]
        while any(child.waiting for child in children):
            order = rotated if round_ % 2 == 0 else rotated[::-1]
            for child in order:
                if child.waiting:
                    child.turn()
            round_ += 1
    except BaseException:
        for child in children:
            child.kill()
        raise
    return [child.results() for child in children]


def _median(results: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in results)


def _mode_rows(mode: str, runs: dict[str, list[dict[str, Any]]]) -> list[Row]:
    ours, plain, trl = runs["runtime"], runs["plain"], runs["trl"]
    label = "LoRA vs TRL + peft" if mode == "lora" else f"{mode}"
    # time per supervised token: the step time of a step of the same tokens
    per_token_rounds = [
        (o["step_s"] / o["tokens_per_step"]) / (p["step_s"] / p["tokens_per_step"])
        for o, p in zip(ours, plain, strict=True)
    ]
    vs_trl_rounds = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, trl, strict=True)]
    per_token, vs_trl = statistics.median(per_token_rounds), statistics.median(vs_trl_rounds)
    rows = [
        Row(
            name=f"{label}: step time per supervised token, sft-runtime vs plain loop",
            value=_median(ours, "step_s") / _median(ours, "tokens_per_step") * 1e3,
            unit="ms/tok",
            reference=_median(plain, "step_s") / _median(plain, "tokens_per_step") * 1e3,
            ratio=per_token,
            target=f"<= {STEP_TARGET}",
            ok=per_token <= STEP_TARGET,
        ),
        Row(
            name=f"{label}: supervised tokens/s, sft-runtime vs TRL",
            value=_median(ours, "tokens_per_s"),
            unit="tok/s",
            reference=_median(trl, "tokens_per_s"),
            ratio=vs_trl,
            target=f">= {TRL_TARGET}",
            ok=vs_trl >= TRL_TARGET,
        ),
        Row(
            name=f"{label}: supervised tokens/s, plain loop (the limit)",
            value=_median(plain, "tokens_per_s"),
            unit="tok/s",
        ),
    ]
    for ratios, name in ((per_token_rounds, "step vs plain loop"), (vs_trl_rounds, "vs TRL")):
        rows.append(
            Row(
                name=f"{label}: {name}, each round ("
                + ", ".join(f"{r:.3f}" for r in ratios)
                + "); their spread",
                value=max(ratios) - min(ratios),
                unit="x",
            )
        )
    for other, name in ((plain, "plain loop"), (trl, "TRL")):
        rows.append(
            Row(
                name=f"{label}: peak RSS, sft-runtime's worker vs {name}",
                value=_median(ours, "peak_rss_mib"),
                unit="MiB",
                reference=_median(other, "peak_rss_mib"),
                ratio=_median(ours, "peak_rss_mib") / _median(other, "peak_rss_mib"),
            )
        )
    rows.append(
        Row(
            name=f"{label}: minor page faults a step, sft-runtime's worker vs plain loop "
            f"(TRL {_median(trl, 'minor_faults') / 1e3:,.0f}k)",
            value=_median(ours, "minor_faults") / 1e3,
            unit="k",
            reference=_median(plain, "minor_faults") / 1e3,
            ratio=_median(ours, "minor_faults") / max(_median(plain, "minor_faults"), 1),
        )
    )
    if not (rows[0].ok and rows[1].ok):
        rows += _where_the_time_goes(label, runs)
    for note in sorted({n for r in trl for n in r.get("notes", [])}):
        rows.append(Row(name=f"{label}: TRL {note}", value=float("nan"), unit=""))
    return rows


def _where_the_time_goes(label: str, runs: dict[str, list[dict[str, Any]]]) -> list[Row]:
    """A missed target: each side's step split into its parts, per supervised token, and
    the positions its forward passes ran over per real token (padding)."""
    rows = []
    for side in SIDES:
        results = runs[side]
        tokens = _median(results, "tokens_per_step")
        parts = ("load_s", "forward_backward_s", "optimizer_s")
        shown = ", ".join(
            f"{part.removesuffix('_s').replace('forward_backward', 'fwd+bwd')} "
            f"{_median(results, part) / tokens * 1e3:.2f}"
            for part in parts
            if _median(results, part) > 0
        )
        padding = _median(results, "computed_tokens") / max(_median(results, "real_tokens"), 1)
        rows.append(
            Row(
                name=f"{label}: {side} ms/supervised token ({shown or 'not split'}); "
                "positions run per token",
                value=padding,
                unit="x",
            )
        )
    return rows


def run() -> list[dict]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-real-model-"))
    rows: list[Row] = []
    try:
        model, template = _model(scratch)
        most_rows = max(m["rows"] for m in MODES.values())
        chats, data = _data(scratch, model, count=most_rows * STEPS * 2)
        jobs = []  # (mode, round, side, setup file, work folder), in the order they run
        for mode, shape in MODES.items():
            setup = Setup(
                model_dir=str(model),
                data_dir=str(data),
                chats=str(chats),
                generation_template=template,
                steps=STEPS,
                warmup=WARMUP,
                seq=SEQ,
                threads=THREADS,
                **shape,
            )
            setup_file = scratch / f"{mode}.json"
            setup_file.write_text(json.dumps(asdict(setup)))
            for round_ in range(ROUNDS):
                for side in SIDES:
                    work = scratch / "work" / f"{mode}-{side}-{round_}"
                    jobs.append((mode, round_, side, setup_file, work))
        # children that take turns: the three sides of a round of a mode, or (smoke) one per
        # side running its every job
        if FRESH_PROCESS_PER_RUN:
            keys = list(dict.fromkeys((mode, round_) for mode, round_, *_ in jobs))
            sittings = [[j for j in jobs if (j[0], j[1]) == key] for key in keys]
        else:
            sittings = [jobs]
        results = {}
        for sitting in sittings:
            groups = [[j for j in sitting if j[2] == side] for side in SIDES]
            first = sitting[0][1] % len(SIDES)  # the round: each side opens one of three
            got = _in_turns(
                [[(side, setup, work) for *_, side, setup, work in g] for g in groups], first
            )
            for group, group_results in zip(groups, got, strict=True):
                for (mode, round_, side, _, work), result in zip(group, group_results, strict=True):
                    results[mode, round_, side] = result
                    shutil.rmtree(work, ignore_errors=True)
        for mode in MODES:
            runs = {side: [results[mode, r, side] for r in range(ROUNDS)] for side in SIDES}
            rows += _mode_rows(mode, runs)
            trainable = runs["runtime"][0]["trainable"]
            rows.append(Row(name=f"{mode}: trainable parameters", value=trainable / 1e6, unit="M"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return [row.as_dict() for row in rows]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        jobs = sys.argv[2:]
        for i in range(0, len(jobs), 3):
            print(MARK + json.dumps(run_side(*jobs[i : i + 3])), flush=True)
        sys.exit(0)
    h.main(run, __doc__)

"""Step time of sft-runtime training a Hugging Face model against a plain transformers loop.

`overhead.py` prices the runtime around its own small transformer; a user who brings an HF
checkpoint compares with the loop they would write themselves: ``AutoModelForCausalLM`` and
AdamW on the same batches (`plain_loop.py` with ``policy.model_name``). The model is a
Llama folder as on the hub (trained tokenizer and chat template, `tests.support.hf_models`),
widened so a step is compute-bound, since a tiny step would make any fixed cost look huge.
DP=1 leaves one of this machine's two cores to the runtime's controller (the plain loop has
none). The plain loop reads the very batches the runtime's loader yields, written
beforehand, so it does no loading and the losses must agree. Target: sft-runtime <= 1.05x.

The runtime's loader runs as a user with an HF tokenizer runs it: energon with one worker
process (``data.num_workers=1``), which renders and tokenizes the next batches on the
free core while the current one trains; the plain loop gets its batches for free, so what
is left is the runtime's own price (Ray calls, controller, events, spans, checkpoints) and
whatever the loading on the other core takes from the step (see below). A second runtime
side loads inline (``num_workers=0``, the harness's default elsewhere): the
model's own BPE tokenizer and chat template cost far more per sample than the byte
tokenizer `overhead.py` runs, and a row shows that share apart.

This machine's speed drifts by 10% and more within a minute, more than the target allows,
so the target is judged in turns (`interleave.py`): both sides are up at once, the runtime
trains 4 steps while the plain loop waits, then is frozen while the plain loop trains the
same 4 batches, and so on (the plain loop goes first in every other run);
``in_turns.sft_runtime_over_plain`` is the median of ten such runs (one run alone varies
by several percent, from process to process), and ``in_turns.plain_over_plain``, the plain
loop in turns with itself, shows how finely that resolves. The rows after them time whole
runs one after the other instead: each runtime run against the mean of the plain runs just
before and just after it, the median of four such ratios. Two more rows split that ratio
in two: ``interval_over_model_work`` (the runtime's step interval over the model work
inside that same run: forward/backward, all-reduce, optimizer, what the plain loop does;
no drift between runs moves it) and
``model_work_over_plain_step`` (that model work over the plain loop's whole step: how much
slower the same computation ran inside the runtime, for the inline side too). The last
explains the second: ``plain_beside_a_busy_core`` is the plain loop while another process
renders and tokenizes chats flat out on the machine's other core. On these 2-core VMs that
alone slows the step, so loading on "the free core" is not free here. ``checkpoint_cost`` is
what a save adds to the step after it (the plain loop saves nothing), from the same run.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as h  # noqa: E402
from bench import interleave as il  # noqa: E402
from bench import zygote  # noqa: E402
from bench.plain_loop import plain_run, pretokenize  # noqa: E402

TARGET = 1.05
ROUNDS = h.pick(4, 1)
# Checkpoints at 10, 20 and 30 inside the timed window (as often as a run saves them); a
# longer window than `h.STEPS` also evens out the machine's short slow spells. Smoke: one
# save (`h.SAVE_PERIOD`) inside the window.
STEPS = h.pick(32, h.WARMUP + 3)
WORLD = 1
# The test folder's Llama (hidden 64) is so small that fixed costs would rule its step; this
# one takes about 200 ms a step on one core here.
LLAMA = h.pick(
    {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2},
    {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1},
)
SHAPE = {**h.COMPUTE, "packing": False}  # the plain HF forward takes one sample per row
# Two forwards that differ only in how they mask padding differ by float rounding at most.
LOSS_TOLERANCE = 1e-4
# Full: BUSY_ROUNDS plain runs beside a busy core, each between quiet ones. Smoke: the first
# plain run goes beside the busy core and stands for the quiet ones too: one `plain_run` and
# one busy loop run the code of both (smoke figures mean nothing).
BUSY_ROUNDS = h.pick(2, 0)
BUSY_FIRST = h.pick(False, True)
# Full: each runtime run, and each run beside a busy core, is judged against plain runs of
# its own just before and just after it, since the machine drifts. Smoke: the first plain
# run stands for all of those (each is a process of its own, and smoke figures mean nothing).
FRESH_REFERENCES = h.pick(True, False)
# Full: a run loading inline follows each runtime run. Smoke: the runtime run stands for it
# (the same `h.runtime_run`; loading inline with an HF tokenizer trains in
# tests/integration/policy/test_hf_training.py, and smoke figures mean nothing).
INLINE_RUNS = h.pick(True, False)
TURN_ROUNDS = h.pick(10, 1)  # even: each side goes first on the batches in half of them
# A loader's work without the loader: the model's tokenizer renders and tokenizes a chat over
# and over, in a process of its own, until it is killed.
BUSY_LOOP = """
import sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
chat = [
    {"role": "user", "content": "Name three rivers of Europe. " * 8},
    {"role": "assistant", "content": "The Danube, the Rhine and the Loire. " * 8},
]
print("looping", flush=True)
while True:
    tokenizer.apply_chat_template(chat, tokenize=True)
"""


def model_dir(out: Path) -> Path:
    """A hub-like Llama folder, its model widened to `LLAMA` (same tokenizer, same ids)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from tests.support.hf_models import hf_model_dir

    hf_logging.disable_progress_bar()  # a bar per saved shard
    folder = hf_model_dir(out, family="llama")
    config = AutoConfig.from_pretrained(folder)
    config.update(LLAMA)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(h.SEED)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return folder


def raw_config(data: Path, model: Path, run_dir: Path, workers: int = 1, prefetch: int = 2) -> dict:
    raw = h.raw_config(SHAPE, data, run_dir, STEPS, world=WORLD, prefetch=prefetch)
    raw["policy"].pop("model", None)
    raw["policy"]["model_name"] = str(model)  # its tokenizer too
    raw["data"]["num_workers"] = workers
    return raw


def run() -> list[dict]:
    """sft-runtime vs the plain transformers loop: plain, runtime, plain, inline, plain, ..."""
    # own_ray: the turns freeze the run's processes, found under this one (`h.ray_root`)
    with h.workspace(own_ray=True) as (data, tmp):
        return _hf_step(data, tmp)


def _hf_step(data: Path, tmp: Path) -> list[dict]:
    model = model_dir(tmp / "tiny-llama")
    batches = pretokenize(raw_config(data, model, tmp), WORLD, STEPS, tmp / "batches.pt")
    tokens = _tokens_per_step(batches)
    plain_losses: list[list[float]] = []

    def plain() -> float:
        out = plain_run(raw_config(data, model, tmp), WORLD, STEPS, batches)
        plain_losses.append(out["losses"])
        return h.step_time(out["times"])

    def busy_plain() -> float:
        with other_core_busy(model):
            return plain()

    first = busy_plain() if BUSY_FIRST else plain()

    def reference() -> float:
        """The step time of a quiet plain run: a new one, or the first (`FRESH_REFERENCES`)."""
        return plain() if FRESH_REFERENCES else first

    ref, sub, ratios, extra, diffs, shares, saves = [], [], [], [], [], [], []
    inline, inline_ratios, load, work, inline_work = [], [], [], [], []
    before = first
    for i in range(ROUNDS):
        raw = raw_config(data, model, tmp / f"run-{i}")
        ours = h.runtime_run(raw)
        t_sub, between = h.step_time(ours["times"]), reference()
        t_ref = (before + between) / 2  # the plain loop just before and just after
        ref.append(t_ref)
        sub.append(t_sub)
        ratios.append(t_sub / t_ref)
        extra.append(t_sub - t_ref)
        model_work = statistics.mean(ours["model_work"][h.WARMUP :])
        shares.append(t_sub / model_work)
        saves.append(h.save_cost(ours, raw["checkpointing"]["save_period"]))
        work.append(model_work / t_ref)
        pairs = zip(plain_losses[-1], ours["losses"], strict=True)
        diffs.append(max(abs(a - b) for a, b in pairs))
        # loading inline: the worker renders and tokenizes each batch before it trains on it
        inline_raw = raw_config(data, model, tmp / f"inline-{i}", workers=0, prefetch=1)
        alone = h.runtime_run(inline_raw) if INLINE_RUNS else ours
        inline.append(h.step_time(alone["times"]))
        before = reference()
        inline_ratios.append(inline[-1] / ((between + before) / 2))
        inline_work.append(statistics.mean(alone["model_work"][h.WARMUP :]) / t_ref)
        load.append(statistics.median(alone["load"][h.WARMUP :]))
        assert alone["losses"] == ours["losses"], "a loader worker process changed the losses"
        print(
            f"hf_step.py: round {i + 1}/{ROUNDS}: plain {between * 1e3:.1f} ms, "
            f"sft-runtime {t_sub * 1e3:.1f} ms ({ratios[-1]:.3f}x the plain runs either side), "
            f"loading inline {inline[-1] * 1e3:.1f} ms, max loss diff {diffs[-1]:.2e}",
            file=sys.stderr,
            flush=True,
        )
    turns, turns_work, turns_aa = [], [], []  # both sides up at once, in turns (interleave.py)
    for i in range(TURN_ROUNDS):
        second = i % 2 == 1  # every other run the plain loop goes first on each batch
        raw = raw_config(data, model, tmp / f"turns-{i}")
        out = il.runtime_vs_plain(raw, batches, STEPS, plain_opens=second)
        turns.append(out["ratio"])
        turns_work.append(out["model_work_over_plain"])
        turns_aa.append(il.plain_vs_plain(raw, batches, STEPS, b_opens=second))
        diffs.append(max(abs(a - b) for a, b in zip(*out["losses"], strict=True)))
        print(
            f"hf_step.py: turns {i + 1}/{TURN_ROUNDS}: sft-runtime {turns[-1]:.3f}x the plain "
            f"loop, plain loop {turns_aa[-1]:.3f}x itself",
            file=sys.stderr,
            flush=True,
        )
    contention = []  # the plain loop beside a busy core, against its quiet runs either side
    for _ in range(BUSY_ROUNDS):
        t_busy = busy_plain()
        after = reference()
        contention.append(t_busy / ((before + after) / 2))
        before = after
    if BUSY_FIRST:  # the busy run against the quiet runs it stands for: itself
        contention.append(first / first)
    ratio, t_ref, t_sub = statistics.median(ratios), statistics.median(ref), statistics.median(sub)
    turns_ratio = statistics.median(turns)
    inline_ratio, t_inline = statistics.median(inline_ratios), statistics.median(inline)
    diff = max(diffs)
    ms = 1e3
    return [
        h.row(
            "hf.step.in_turns.sft_runtime_over_plain (same batches, turns of 4 steps)",
            turns_ratio,
            "x",
            None,
            f"<= {TARGET}x",
            turns_ratio <= TARGET,
        ),
        h.row(
            "hf.step.in_turns.plain_over_plain (what turns cannot cancel)",
            statistics.median(turns_aa),
            "x",
        ),
        h.row("hf.step.in_turns.model_work_over_plain_step", statistics.median(turns_work), "x"),
        h.row(
            "hf.step.time.sft_runtime (data.num_workers=1, whole runs)",
            t_sub * ms,
            "ms",
            t_ref * ms,
            None,
            None,
            ratio,
        ),
        h.row(
            "hf.step.time.sft_runtime_loading_inline (num_workers=0)",
            t_inline * ms,
            "ms",
            t_ref * ms,
            None,
            None,
            inline_ratio,
        ),
        h.row(
            "hf.step.interval_over_model_work (same run)",
            statistics.median(shares),
            "x",
        ),
        h.row("hf.step.model_work_over_plain_step", statistics.median(work), "x"),
        h.row(
            "hf.step.checkpoint_cost (added to the step after a save, same run)",
            statistics.median(saves) * ms,
            "ms",
        ),
        h.row(
            "hf.step.model_work_over_plain_step_loading_inline",
            statistics.median(inline_work),
            "x",
        ),
        h.row(
            "hf.step.plain_beside_a_busy_core (chats tokenized on the other core)",
            statistics.median(contention),
            "x",
        ),
        h.row("hf.step.tokens_per_s.sft_runtime", tokens / t_sub, "tokens/s", tokens / t_ref),
        h.row(
            "hf.step.overhead_per_step (sft-runtime - plain)", statistics.median(extra) * ms, "ms"
        ),
        h.row(
            "hf.step.loading_inline_per_step (HF tokenizer and template)",
            statistics.median(load) * ms,
            "ms",
        ),
        {
            **h.row(
                "hf.step.max_loss_diff_vs_plain",
                diff,
                "nats",
                None,
                f"<= {LOSS_TOLERANCE:g}",
                diff <= LOSS_TOLERANCE,
            ),
            "note": _loss_note(diff),
        },
    ]


@contextmanager
def other_core_busy(model: Path) -> Iterator[None]:
    """`BUSY_LOOP` running beside the block, with the model folder's tokenizer."""
    proc = zygote.Popen(
        [sys.executable, "-c", BUSY_LOOP, str(model)], stdout=subprocess.PIPE, text=True
    )
    try:
        if proc.stdout.readline().strip() != "looping":
            raise RuntimeError(f"the busy loop did not start (exit {proc.poll()})")
        yield
    finally:
        proc.kill()
        proc.wait()


def _tokens_per_step(batches: Path) -> float:
    """Mean tokens of the steps `h.step_time` times, padding left out (both sides compute
    it, neither learns from it)."""
    import torch

    steps = torch.load(batches, weights_only=False)[0][h.WARMUP :]
    return sum(int((b.segment_ids >= 0).sum()) for b in steps) / len(steps)


def _loss_note(diff: float) -> str:
    if diff == 0.0:
        return "bitwise equal"
    return (
        "not bitwise: both sides give the model the same rows and 2-D padding mask, so the "
        "kernels they ran rounded differently; AdamW carries that into later steps"
    )


if __name__ == "__main__":
    h.main(run, __doc__)

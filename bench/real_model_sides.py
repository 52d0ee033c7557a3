"""The three trainers bench/real_model.py holds side by side, each in a process of its own.

Each trains the same model on the same conversations with the same hyper-parameters
(`Setup`: lr, rows a step, rows a micro-batch, max length, assistant-only loss, AdamW,
constant LR, clipping at 1.0) and reports the same figures (`Result`): seconds per step and
supervised tokens per step over the steps after the warm-up, where a step's time went, the
tokens its forward passes ran over (padding included) and the process's peak RSS.

- ``runtime``: sft-runtime's worker without Ray: its colocated energon loader and its
  `Replica` (what a policy worker runs for a step: begin, train, finish, then commit).
- ``plain``: the loop a careful user writes with transformers alone: ``apply_chat_template``
  with the assistant mask, micro-batches padded to their own longest row; packed, the rows
  of a micro-batch laid end to end in one sequence with a block-diagonal causal mask (with
  SDPA, ``position_ids`` alone would let packed samples see each other).
- ``trl``: TRL's `SFTTrainer` (``assistant_only_loss``, ``packing`` with its padding-free
  rows), counting the supervised tokens of every micro-batch it trains on.

The sides run at once, one process each, and take turns a step at a time (`Turns`): a side
waits on a pipe before each step and after its last, so only one of them computes at any
moment and a slow spell of the machine falls on all of them alike. A step is timed from the
moment its turn came, so getting its batch is part of it on every side.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Setup:
    """One mode's run, the same for every side."""

    model_dir: str
    data_dir: str  # prepared energon data set (the runtime reads this)
    chats: str  # the same conversations as JSONL (the plain loop and TRL read this)
    generation_template: str | None  # the model's template with {% generation %} markers
    steps: int
    warmup: int
    rows: int  # a step's rows (unpacked: conversations; packed: packed rows)
    micro: int
    seq: int
    lr: float
    packed: bool
    lora: dict[str, Any] | None
    threads: int
    seed: int = 5


@dataclass
class Result:
    step_s: float = 0.0  # mean seconds per step after the warm-up
    tokens_per_step: float = 0.0  # supervised tokens (targets) per step after the warm-up
    load_s: float = 0.0  # per step: getting the batch
    forward_backward_s: float = 0.0  # per step
    optimizer_s: float = 0.0  # per step: clip and AdamW (and the all-reduce, for the runtime)
    computed_tokens: float = 0.0  # per step: positions the forward passes ran over
    real_tokens: float = 0.0  # per step: positions holding a token
    peak_rss_mib: float = 0.0
    # per step: minor page faults, memory the process touched for the first time (fresh
    # pages from the kernel, zeroed, where a reused buffer costs nothing)
    minor_faults: float = 0.0
    trainable: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s else 0.0


TURNS_ENV = "SFT_BENCH_REAL_MODEL_TURNS"  # "go fd,ready fd" of a child taking turns


class Turns:
    """A side's end of the turn pipes: `take` says "ready" and blocks until told "go".

    Without the pipes (a side run on its own) it only reads the clock."""

    def __init__(self, fds: str | None) -> None:
        self._go, self._ready = (int(fd) for fd in fds.split(",")) if fds else (-1, -1)
        self.faults: list[int] = []  # the process's minor page faults at each turn

    def take(self) -> float:
        """Block until this side's turn comes; the time it came (`time.perf_counter`)."""
        if self._go >= 0:
            os.write(self._ready, b"r")
            if os.read(self._go, 1) != b"g":
                raise RuntimeError("the bench that hands out turns went away")
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        return time.perf_counter()

    def faults_per_step(self, warmup: int) -> float:
        """Mean minor page faults of a step after the warm-up (a step runs from one turn to
        the next)."""
        steps = [b - a for a, b in zip(self.faults, self.faults[1:], strict=False)][warmup:]
        return sum(steps) / len(steps) if steps else 0.0


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _window(result: Result, per_step: list[dict[str, float]], warmup: int) -> Result:
    """Means over the steps after the warm-up."""
    kept = per_step[warmup:] or per_step
    for key in ("step_s", "load_s", "forward_backward_s", "optimizer_s"):
        setattr(result, key, sum(s.get(key, 0.0) for s in kept) / len(kept))
    for key in ("computed_tokens", "real_tokens"):
        setattr(result, key, sum(s.get(key, 0.0) for s in kept) / len(kept))
    result.tokens_per_step = sum(s["tokens"] for s in kept) / len(kept)
    result.peak_rss_mib = _peak_rss_mib()
    return result


def _conversations(setup: Setup) -> list[list[dict[str, str]]]:
    with open(setup.chats, encoding="utf-8") as handle:
        return [json.loads(line)["messages"] for line in handle if line.strip()]


# ----------------------------------------------------------------------------- sft-runtime
def runtime_config(setup: Setup, run_dir: Path) -> dict[str, Any]:
    """The run config of the runtime side (DP=1)."""
    policy: dict[str, Any] = {
        "model_name": setup.model_dir,
        "train_global_batch_size": conversations_per_step(setup),
        "train_micro_batch_size": setup.micro,
        "max_grad_norm": 1.0,
        # TRL's and the plain loop's AdamW: torch's defaults
        "optimizer": {
            "kwargs": {"lr": setup.lr, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
        },
    }
    # a whole replica in float32 like the other sides (NeMo RL's defaults: FSDP2, bfloat16)
    policy["precision"] = "float32"
    policy["dtensor_cfg"] = {"enabled": False}
    energon: dict[str, Any] = {"shuffle_buffer_size": None}
    if setup.lora:
        policy["dtensor_cfg"]["lora_cfg"] = {"enabled": True, **setup.lora}
    if setup.packed:
        policy["sequence_packing"] = {"enabled": True, "algorithm": "first_fit_decreasing"}
    return {
        "policy": policy,
        "data": {
            "max_input_seq_length": setup.seq,
            "num_workers": 0,
            "train": {"path": setup.data_dir, "virtual_epoch_length": 10_000},
            "energon": energon,
            "add_bos": False,
            "add_generation_prompt": True,
        },
        "sft": {"max_num_steps": setup.steps, "max_num_epochs": 100, "seed": setup.seed},
        "logger": {"log_dir": str(run_dir), "tensorboard_enabled": False, "monitor_gpus": False},
        "cluster": {
            "gpus_per_node": 0,
            "workers_per_node": 1,
            "num_threads_per_worker": setup.threads,
        },
        "checkpointing": {"enabled": False},
    }


def train_runtime(setup: Setup, work: Path, turns: Turns) -> Result:
    import torch

    from sft_runtime.runtime.config import loader_spec, validate_config
    from sft_runtime.runtime.data.loader import ColocatedLoader
    from sft_runtime.runtime.policy.loss import NLLLossFn
    from sft_runtime.runtime.policy.replica import Replica

    config = validate_config(runtime_config(setup, work / "run"))
    loader = ColocatedLoader(loader_spec(config, 1), 0, 1, "bench")
    loader.setup()
    replica = Replica(config.policy, seed=setup.seed, device=torch.device("cpu"))
    per_step = []
    try:
        for _ in range(setup.steps):
            t0 = turns.take()
            loader.load()
            batch = loader.active_batch
            t1 = time.perf_counter()
            replica.begin(NLLLossFn(), lambda batch=batch: batch)
            trained = replica.train(batch)
            t2 = time.perf_counter()
            out = replica.finish()
            loader.commit()
            t3 = time.perf_counter()
            computed = 0
            for start in range(0, batch.num_rows, setup.micro):
                rows = batch.rows(start, min(start + setup.micro, batch.num_rows))
                computed += replica.forward_rows(rows).input_ids.numel()
            per_step.append(
                {
                    "step_s": t3 - t0,
                    "load_s": t1 - t0,
                    "forward_backward_s": trained["forward_backward_s"],
                    "optimizer_s": t3 - t2,
                    "tokens": out.valid_tokens,
                    "computed_tokens": computed,
                    "real_tokens": int((batch.segment_ids >= 0).sum()),
                }
            )
        turns.take()
    finally:
        loader.close()
    result = Result(trainable=sum(p.numel() for p in replica.params))
    return _window(result, per_step, setup.warmup)


# ----------------------------------------------------------------------------- plain loop
def _plain_model(setup: Setup):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        setup.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    if setup.lora:
        import peft

        from sft_runtime.runtime.lora.adapters import target_modules
        from sft_runtime.runtime.lora.config import LoraConfig

        cfg = LoraConfig.model_validate({"enabled": True, **setup.lora})
        targets = target_modules(model, cfg)
        model = peft.get_peft_model(
            model,
            peft.LoraConfig(r=cfg.dim, lora_alpha=cfg.alpha, target_modules=targets),
        )
    return model


def _encoded(setup: Setup) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) per conversation, from the template's generation markers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(setup.model_dir)
    out = []
    for messages in _conversations(setup):
        enc = tok.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            chat_template=setup.generation_template,
        )
        out.append((enc["input_ids"][: setup.seq], enc["assistant_masks"][: setup.seq]))
    return out


def conversations_per_step(setup: Setup) -> int:
    """The runtime's global batch, which counts conversations (as NeMo RL's does): unpacked
    a step's rows; packed, as many as the other sides' packed rows a step hold on average,
    so that every side trains about the same tokens a step (a multiple of the micro-batch)."""
    if not setup.packed:
        return setup.rows
    encoded = _encoded(setup)
    per_row = len(encoded) / len(_packed_rows(encoded, setup.seq))
    return max(setup.micro, round(per_row * setup.rows / setup.micro) * setup.micro)


def _packed_rows(encoded, seq: int) -> list[list[tuple[list[int], list[int]]]]:
    """First-fit decreasing into rows of at most ``seq`` tokens, as the runtime packs."""
    rows: list[list] = []
    room: list[int] = []
    for ids, mask in sorted(encoded, key=lambda e: -len(e[0])):
        for r, left in enumerate(room):
            if len(ids) <= left:
                rows[r].append((ids, mask))
                room[r] -= len(ids)
                break
        else:
            rows.append([(ids, mask)])
            room.append(seq - len(ids))
    return rows


@dataclass
class _Micro:
    ids: Any
    targets: Any  # weight of the prediction of token t + 1 from position t
    kwargs: dict[str, Any]
    real: int  # positions holding a token


def _plain_micro_batch(items, packed: bool, pad_id: int) -> _Micro:
    """Tensors of one micro-batch: padded rows, or the rows end to end in one sequence."""
    import torch

    if packed:
        samples = [s for row in items for s in row]
        ids = torch.tensor([[t for s, _ in samples for t in s]])
        mask = torch.tensor([[m for _, ms in samples for m in ms]], dtype=torch.float32)
        positions = torch.cat([torch.arange(len(s)) for s, _ in samples]).unsqueeze(0)
        segments = torch.cat([torch.full((len(s),), i) for i, (s, _) in enumerate(samples)])
        allowed = (segments.unsqueeze(0) == segments.unsqueeze(1)).tril()
        attention = torch.zeros(allowed.shape).masked_fill_(
            ~allowed, torch.finfo(torch.float32).min
        )
        kwargs = {"position_ids": positions, "attention_mask": attention[None, None]}
        return _Micro(ids, mask[:, 1:], kwargs, ids.numel())
    width = max(len(s) for s, _ in items)
    ids = torch.full((len(items), width), pad_id)
    mask = torch.zeros((len(items), width))
    attention = torch.zeros((len(items), width), dtype=torch.long)
    for r, (s, ms) in enumerate(items):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = torch.tensor(ms, dtype=torch.float32)
        attention[r, : len(s)] = 1
    return _Micro(ids, mask[:, 1:], {"attention_mask": attention}, int(attention.sum()))


def train_plain(setup: Setup, work: Path, turns: Turns) -> Result:
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    del work
    encoded = _encoded(setup)
    items = _packed_rows(encoded, setup.seq) if setup.packed else encoded
    pad_id = AutoTokenizer.from_pretrained(setup.model_dir).pad_token_id or 0
    model = _plain_model(setup)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=setup.lr, weight_decay=0.0)
    per_step = []
    for step in range(setup.steps):
        t0 = turns.take()
        chunk = [items[(step * setup.rows + i) % len(items)] for i in range(setup.rows)]
        micro = [
            _plain_micro_batch(chunk[i : i + setup.micro], setup.packed, pad_id)
            for i in range(0, setup.rows, setup.micro)
        ]
        total = sum(int(m.targets.sum()) for m in micro)  # the global normalizer
        t1 = time.perf_counter()
        for m in micro:
            logits = model(input_ids=m.ids, use_cache=False, **m.kwargs).logits
            # as transformers' own loss does: the labels shifted and padded with
            # ignore_index, so the logits go in whole (slicing them would copy them)
            labels = F.pad(m.ids[:, 1:], (0, 1), value=-100)
            nll = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]),
                labels.reshape(-1),
                reduction="none",
                ignore_index=-100,
            ).view_as(labels)
            ((nll * F.pad(m.targets, (0, 1))).sum() / max(total, 1)).backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        per_step.append(
            {
                "step_s": t3 - t0,
                "load_s": t1 - t0,
                "forward_backward_s": t2 - t1,
                "optimizer_s": t3 - t2,
                "tokens": total,
                "computed_tokens": sum(m.ids.numel() for m in micro),
                "real_tokens": sum(m.real for m in micro),
            }
        )
    turns.take()
    result = Result(trainable=sum(p.numel() for p in params))
    return _window(result, per_step, setup.warmup)


# ----------------------------------------------------------------------------- TRL
def train_trl(setup: Setup, work: Path, turns: Turns) -> Result:
    import warnings

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    # TRL's own default (gradient_checkpointing) is a name transformers 5 deprecates
    warnings.filterwarnings("ignore", category=FutureWarning)
    tok = AutoTokenizer.from_pretrained(setup.model_dir)
    if setup.generation_template is not None:
        tok.chat_template = setup.generation_template
    chats = _conversations(setup)
    data = Dataset.from_list([{"messages": m} for m in chats])
    model = AutoModelForCausalLM.from_pretrained(
        setup.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    peft_config = None
    if setup.lora:
        import peft

        from sft_runtime.runtime.lora.adapters import target_modules
        from sft_runtime.runtime.lora.config import LoraConfig

        cfg = LoraConfig.model_validate({"enabled": True, **setup.lora})
        peft_config = peft.LoraConfig(
            r=cfg.dim, lora_alpha=cfg.alpha, target_modules=target_modules(model, cfg)
        )
    args = SFTConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=setup.micro,
        gradient_accumulation_steps=setup.rows // setup.micro,
        learning_rate=setup.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=setup.steps,
        max_length=setup.seq,
        assistant_only_loss=True,
        packing=setup.packed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=setup.seed,
        disable_tqdm=True,
        # TRL's defaults differ from transformers' (and from the other sides) here: bf16
        # autocast and activation checkpointing; all three sides train in float32, keeping
        # activations
        bf16=False,
        gradient_checkpointing=False,
    )
    seen = {"tokens": 0, "computed": 0, "real": 0}

    class Counting(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            labels = inputs["labels"]
            seen["tokens"] += int((labels[:, 1:] != -100).sum())
            seen["computed"] += labels.numel()
            mask = inputs.get("attention_mask")
            seen["real"] += int(mask.sum()) if mask is not None else labels.numel()
            return super().training_step(model, inputs, num_items_in_batch)

    # (turn came, step ended, counts at its end): the trainer gets its batch between the two
    marks: list[tuple[float, float, dict[str, int]]] = []
    came = [0.0]

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            came[0] = turns.take()

        def on_step_end(self, args, state, control, **kwargs):
            marks.append((came[0], time.perf_counter(), dict(seen)))
            came[0] = turns.take()

    trainer = Counting(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    trainer.train()
    per_step = []
    before = {"tokens": 0, "computed": 0, "real": 0}
    for start, end, now in marks:
        per_step.append(
            {
                "step_s": end - start,
                "tokens": now["tokens"] - before["tokens"],
                "computed_tokens": now["computed"] - before["computed"],
                "real_tokens": now["real"] - before["real"],
            }
        )
        before = now
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result = Result(trainable=trainable)
    if setup.packed and trainer.model.config._attn_implementation == "sdpa":
        result.notes.append("padding-free rows on sdpa: packed samples attend to each other")
    return _window(result, per_step, setup.warmup)


SIDES = {"runtime": train_runtime, "plain": train_plain, "trl": train_trl}


def run_side(side: str, setup_file: str, work: str) -> dict[str, Any]:
    """One side in this process (a child of bench/real_model.py): its `Result` as a dict."""
    import torch

    os.environ.setdefault("TQDM_DISABLE", "1")
    setup = Setup(**json.loads(Path(setup_file).read_text()))
    torch.set_num_threads(setup.threads)
    turns = Turns(os.environ.get(TURNS_ENV))
    result = SIDES[side](setup, Path(work), turns)
    result.minor_faults = turns.faults_per_step(setup.warmup)
    return {**asdict(result), "tokens_per_s": result.tokens_per_s}

"""The source samples a step trained on, rebuilt from the loaders and proven by the log.

Each logical rank's loader is built as its owning worker builds it (the run's config as the
checkpoint recorded it, the factory the controller ships, the rank, world size and
placement hash the run used), restored from the checkpoint before the step and read
forward, committing batch after batch. Every batch read on the way is checked against the
digest the log recorded for that step and rank, so an answer is never a guess: a data set
or loader code that changed since the run shows up as a `SampleMismatchError` naming the
step and the rank. No Ray, no torch.distributed: loaders only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_runtime.runtime.debug.start import StartPoint, find_start
from sft_runtime.runtime.errors import UserInputError

OPEN, CLOSE = "[[", "]]"  # around the supervised tokens in a sample's text


class SampleMismatchError(RuntimeError):
    """The rebuilt loader did not give the samples the log recorded (exit code 1)."""


@dataclass(frozen=True)
class SourceSample:
    """One source sample as it was trained on: its tokens (truncated as in training) and,
    per token, whether the loss was taken on it."""

    source_id: str
    token_ids: tuple[int, ...]
    supervised: tuple[bool, ...]
    spans: tuple[tuple[str, bool], ...]  # decoded runs of equally supervised tokens

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def supervised_tokens(self) -> int:
        return sum(self.supervised)

    @property
    def text(self) -> str:
        """The conversation as text, supervised runs between ``[[`` and ``]]``."""
        return "".join(f"{OPEN}{t}{CLOSE}" if sup else t for t, sup in self.spans)

    def to_json(self) -> dict[str, Any]:
        return {
            "source_id": self.source_id,
            "tokens": self.tokens,
            "supervised_tokens": self.supervised_tokens,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "supervised": [int(s) for s in self.supervised],
        }


@dataclass(frozen=True)
class RankSamples:
    rank: int
    digest: str  # the log's digest for this step and rank, which the samples reproduce
    samples: tuple[SourceSample, ...]


@dataclass(frozen=True)
class StepSamples:
    start: StartPoint
    ranks: tuple[RankSamples, ...]


def decode_spans(
    tokenizer: Any, ids: Sequence[int], supervised: Sequence[bool]
) -> tuple[tuple[str, bool], ...]:
    """Decode each maximal run of tokens that are all supervised or all context."""
    spans: list[tuple[str, bool]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or supervised[i] != supervised[start]:
            spans.append((tokenizer.decode(list(ids[start:i])), bool(supervised[start])))
            start = i
    return tuple(spans)


def batch_samples(batch: Any, tokenizer: Any) -> tuple[SourceSample, ...]:
    """The source samples of an `SFTBatch`, one per packed segment, in source-id order."""
    out: list[SourceSample] = []
    for row, offsets in enumerate(batch.cu_seqlens):
        ids_row = batch.input_ids[row].tolist()
        mask_row = batch.loss_mask[row].tolist()
        for start, stop in zip(offsets, offsets[1:], strict=False):
            ids = tuple(ids_row[start:stop])
            supervised = tuple(m > 0 for m in mask_row[start:stop])
            source_id = batch.source_ids[len(out)]
            out.append(
                SourceSample(source_id, ids, supervised, decode_spans(tokenizer, ids, supervised))
            )
    return tuple(out)


def read_rank(
    start: StartPoint,
    spec: Any,
    rank: int,
    world: int,
    placement_hash: str,
    state: bytes | None,
) -> RankSamples:
    """Restore one rank's loader at the checkpoint (or build it fresh, from the run's start:
    ``state`` None) and read up to ``start.step``, checking every batch's digest against the
    log."""
    from sft_runtime.runtime.checkpoint.loader_states import load_loader_state
    from sft_runtime.runtime.data.factory import build_colocated_loader
    from sft_runtime.runtime.data.tokenizer import build_tokenizer
    from sft_runtime.runtime.metrics.step_metrics import sample_digest

    loader = build_colocated_loader(spec, rank, world, placement_hash)
    try:
        loader.setup(None if state is None else load_loader_state(state))
        batch = None
        for step in range(start.checkpoint + 1, start.step + 1):
            envelope = loader.load()
            got, logged = sample_digest(envelope.source_ids), start.facts[step].digests[rank]
            if got != logged:
                raise SampleMismatchError(
                    f"step {step}, logical rank {rank}: the loader started from "
                    f"{start.origin} gives samples with digest {got}, the log "
                    f"recorded {logged} (the data set or the loader changed since the run)"
                )
            batch = loader.active_batch
            loader.commit()
    finally:
        loader.close()
    return RankSamples(rank, logged, batch_samples(batch, build_tokenizer(spec.tokenizer)))


def step_samples(
    run_dir: Path | str,
    step: int,
    *,
    ranks: Sequence[int] | None = None,
    checkpoint_dir: Path | str | None = None,
) -> StepSamples:
    """The samples of step ``step`` per logical rank (all ranks, or ``ranks``)."""
    from sft_runtime.runtime.checkpoint.resume import check_checkpoint
    from sft_runtime.runtime.config import load_config, loader_spec

    start = find_start(run_dir, step, checkpoint_dir=checkpoint_dir, from_run_start=True)
    logged = start.facts[step].digests
    if start.checkpoint == 0:
        began = _run_started(start)
        placement_hash = began["placement_hash"]
        world = began.get("logical_world_size") or len(logged)
        states: list[bytes | None] = [None] * world
    else:
        saved, states, _ = check_checkpoint(start.reader(), start.checkpoints, start.checkpoint)
        placement_hash, world = saved.placement_hash, len(states)
    if len(logged) != world:
        raise UserInputError(
            f"{start.log}: step {step} records {len(logged)} sample digests but "
            f"{start.origin} holds loader states of {world} logical ranks"
        )
    chosen = list(range(world)) if ranks is None else list(ranks)
    for rank in chosen:
        if not 0 <= rank < world:
            raise UserInputError(f"--rank {rank}: the run has logical ranks 0..{world - 1}")
    config = load_config(start.config_path)
    # A sample the template refused is shown as the place it held (the stream is the same
    # with or without the skip), not refused again: the run that trained past it skipped it.
    spec = loader_spec(config, world).model_copy(update={"skip_bad_samples": True})
    found = [read_rank(start, spec, rank, world, placement_hash, states[rank]) for rank in chosen]
    return StepSamples(start, tuple(found))


def _run_started(start: StartPoint) -> dict[str, Any]:
    """The payload of the ``run_started`` the re-run begins at."""
    for rec in start.reader():
        if rec.line == start.checkpoint_line:
            return rec.data
    raise UserInputError(f"{start.log}: line {start.checkpoint_line} is gone")

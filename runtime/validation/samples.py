"""`ValidationShare`: one worker's share of the validation samples, as micro-batches.

The samples are the first ``num_samples`` of the split (or all of them) in the order they are
stored, read once through energon's validation dataset (no shuffling, no repetition). Sample
``p`` of that order belongs to rank ``p % world_size``. So the selection, and the loss, do not
depend on the number of ranks: DP 1 and DP 2 validate the same samples. Each rank renders and
tokenizes only its own samples, with the training loader's task encoder (the same chat
template, loss mask and length rule), and keeps them for the next pass: they never change.

Every rank runs the same number of micro-batches (a sharded forward is a collective): a rank
whose share is shorter, or whose samples were skipped, runs an empty row that weighs nothing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sft_runtime.runtime.data.batch import SFTBatch
from sft_runtime.runtime.data.quiet_progress import quiet_progress_bars
from sft_runtime.runtime.data.tokenizer import build_tokenizer
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.validation.config import ValidationSpec


class ValidationShare:
    """Rank ``rank``'s samples of the pass ``spec`` describes, rendered once."""

    def __init__(self, spec: ValidationSpec, rank: int, world_size: int) -> None:
        from megatron.energon import SkipSample

        from sft_runtime.runtime.data.task_encoder import EncodedChat, SFTTaskEncoder

        self.spec = spec
        tokenizer = build_tokenizer(spec.tokenizer)
        self._pad_id = tokenizer.pad_id
        encoder = SFTTaskEncoder(
            tokenizer,
            max_input_seq_length=spec.max_input_seq_length,
            pad_multiple=spec.pad_multiple,
            only_unmask_final=spec.only_unmask_final,
            overlong=spec.overlong_samples,
            chat_format=spec.chat_format,
            prompt=spec.prompt,
        )
        samples = _stored_samples(spec)
        self.total = len(samples)  # samples in the pass, over every rank
        self.source_ids = [s.__key__ for s in samples[rank::world_size]]
        self.rows: list[EncodedChat | None] = []  # None: skipped (nothing to learn from)
        self.overlong = 0
        for sample in samples[rank::world_size]:
            try:
                row = encoder.encode_sample(sample)
            except SkipSample:
                self.rows.append(None)
                continue
            if row.refused and not spec.skip_bad_samples:
                key, message = row.refused[0]
                raise UserInputError(
                    f"data.validation {spec.data_path!r} split {spec.split!r}: sample {key} "
                    f"cannot be rendered by the chat template ({message}); fix the sample or "
                    "set data.skip_bad_samples=true"
                )
            self.overlong += bool(row.overlong)
            self.rows.append(None if row.refused else row)
        share = math.ceil(self.total / world_size)
        self.num_micro_batches = max(1, math.ceil(share / spec.micro_batch_size))

    @property
    def samples(self) -> int:
        """Samples this rank validates (skipped ones left out)."""
        return sum(row is not None for row in self.rows)

    def micro_batches(self) -> list[SFTBatch]:
        """This rank's rows in micro-batches, padded to the count every rank runs."""
        from sft_runtime.runtime.data.task_encoder import EncodedChat, collate_rows

        size = self.spec.micro_batch_size
        out = []
        for k in range(self.num_micro_batches):
            rows = [r for r in self.rows[k * size : (k + 1) * size] if r is not None]
            if not rows:  # nothing here: one pad token, weight zero, keeps the collectives
                rows = [
                    EncodedChat(
                        __key__="",
                        __restore_key__=(),
                        __subflavors__=None,
                        __sources__=(),
                        source_ids=[],
                        token_ids=[[self._pad_id, self._pad_id]],
                        loss_masks=[[0.0, 0.0]],
                    )
                ]
            out.append(collate_rows(rows, pad_id=self._pad_id, pad_multiple=self.spec.pad_multiple))
        return out


def _stored_samples(spec: ValidationSpec) -> list[Any]:
    """The split's samples in stored order (the first ``num_samples`` of them), unencoded."""
    from megatron.energon import TaskEncoder, WorkerConfig, get_loader, get_val_dataset

    class _AsStored(TaskEncoder):
        def batch(self, samples: list[Any]) -> list[Any]:
            return samples

    quiet_progress_bars()
    path = Path(spec.data_path).expanduser()
    try:
        dataset = get_val_dataset(
            str(path),
            split_part=spec.split,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
            batch_size=1,
            limit=None,
            task_encoder=_AsStored(),
        )
        out = []
        for batch in get_loader(dataset, watchdog_timeout_seconds=None):
            out.extend(batch)
            if spec.num_samples is not None and len(out) >= spec.num_samples:
                break
    except Exception as exc:  # noqa: BLE001 - energon's checks are asserts and ValueErrors
        raise UserInputError(
            f"data.validation.path {str(path)!r} split {spec.split!r}: energon cannot read it "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return out[: spec.num_samples] if spec.num_samples is not None else out

"""How a batch crosses from an energon worker process to the loader: as bytes, not as
shared-memory file descriptors."""

from __future__ import annotations

import pickle
import pickletools
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from sft_runtime.runtime.data.batch import SFTBatch


def _batch(device: str = "cpu") -> SFTBatch:
    ids = torch.arange(16, dtype=torch.long, device=device).reshape(2, 8)
    return SFTBatch(
        input_ids=ids,
        loss_mask=(ids % 3 == 0).float(),
        position_ids=ids % 5,
        segment_ids=torch.zeros_like(ids) - (ids > 12).long(),
        cu_seqlens=[[0, 5, 8], [0, 4]],
        source_ids=["a", "b", "c"],
        sequence_lengths=[5, 3, 4],
    )


def test_the_queue_pickler_sends_the_tensors_as_bytes():
    batch = _batch()
    message = bytes(ForkingPickler.dumps(batch))
    # torch's own reduction would first move each storage into shared memory
    assert not any(getattr(batch, n).is_shared() for n in ("input_ids", "loss_mask"))
    got = pickle.loads(message)
    for name in ("input_ids", "loss_mask", "position_ids", "segment_ids"):
        sent, received = getattr(batch, name), getattr(got, name)
        assert received.dtype == sent.dtype and torch.equal(received, sent), name
        assert not received.is_shared()
    assert (got.cu_seqlens, got.source_ids, got.sequence_lengths) == (
        batch.cu_seqlens,
        batch.source_ids,
        batch.sequence_lengths,
    )


def test_other_picklers_keep_the_dataclass_form():
    batch = _batch()
    got = pickle.loads(pickle.dumps(batch))
    assert torch.equal(got.input_ids, batch.input_ids)
    names = {arg for _, arg, _ in pickletools.genops(pickle.dumps(batch)) if isinstance(arg, str)}
    assert "SFTBatch" in names and "_rebuild" not in names


def test_a_batch_on_a_device_is_refused_by_name():
    with pytest.raises(TypeError, match="SFTBatch on a device"):
        ForkingPickler.dumps(_batch(device="meta"))

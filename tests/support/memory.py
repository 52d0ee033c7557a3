"""`LargestTensor`: what a piece of code allocates at most, op by op, without timing it.

A test that must show memory grows with a share (a rank's slices, one sample's attention)
rather than the whole cannot read RSS reliably on a busy machine; the largest output of any
torch op while the mode is active is exact and does not depend on the allocator. DTensor
outputs are not counted (their ``numel`` is the whole tensor's, which no rank stores); the
ops on their local shards are, and so are only ops that allocate (not views).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output had while active; ``floating_only`` leaves out
    integer and byte tensors (torch.distributed.checkpoint gathers its save plans as byte
    tensors, which grow with the number of tensors, not with their size)."""

    def __init__(self, *, floating_only: bool = False) -> None:
        super().__init__()
        self.largest = 0
        self.floating_only = floating_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view allocates nothing (safetensors slices a mapped file)
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                continue
            if t.is_floating_point() or not self.floating_only:
                self.largest = max(self.largest, t.numel())
        return out

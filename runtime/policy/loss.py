"""Token-level negative log-likelihood, normalized over the whole global batch.

Every rank divides its summed NLL by the number of supervised tokens of the *global* batch
(all DP ranks, all micro-batches), which `begin_train_step` learns from one all-reduce.
Summing the ranks' gradients (not averaging them) then gives exactly the gradient of the
single-process loss on the global batch, whatever the split into ranks and micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sft_runtime.runtime.data.batch import SFTBatch

if TYPE_CHECKING:  # imported where the loss runs (the workers), not where it is built
    import torch


IGNORED = -100  # a target that scores nothing (cross_entropy's ignore_index)


class NLLLossFn:
    """Mean NLL over the supervised tokens of a global batch (logits at t-1 predict t).

    Picklable and stateless, so the controller can ship it to the workers every step.
    """

    def valid_tokens(self, batch: SFTBatch) -> int:
        """Supervised targets this batch contributes (position 0 of a row has no predictor)."""
        return int(batch.loss_mask[:, 1:].sum().item())

    def __call__(
        self, logits: torch.Tensor, batch: SFTBatch, global_valid_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss contribution of one micro-batch and its metrics.

        The returned loss is ``sum(nll * mask) / global_valid_tokens``: summed over ranks and
        micro-batches it is the global mean. The metrics are detached 0-dim tensors (floats
        work too): the replica reads all of a step's metrics in one host sync after the last
        micro-batch, so on a GPU the forward passes queue up without waiting for each other.
        """
        import torch
        import torch.nn.functional as F

        # every position t is scored against token t + 1, the last against nothing
        # (IGNORED): the logits go in whole, where slicing off their last position would
        # copy all of them (a row's logits are a vocabulary wide) whenever a micro-batch has
        # more than one row, and copy their gradient back in the backward pass
        ids = batch.input_ids.to(logits.device)
        targets = F.pad(ids[:, 1:], (0, 1), value=IGNORED)
        mask = F.pad(batch.loss_mask[:, 1:], (0, 1)).to(device=logits.device, dtype=torch.float32)
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            reduction="none",
            ignore_index=IGNORED,
        ).view_as(mask)
        nll_sum = (nll * mask).sum()
        loss = nll_sum / max(int(global_valid_tokens), 1)
        return loss, {
            "nll_sum": nll_sum.detach(),
            "valid_tokens": mask.sum(),
            "loss": loss.detach(),
        }


def read_metrics(micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The micro-batches' metrics as floats, every tensor value read in one host sync."""
    import torch

    tensors = [
        v for metrics in micro_batches for v in metrics.values() if isinstance(v, torch.Tensor)
    ]
    if not tensors:
        return micro_batches
    values = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist())
    return [
        {k: next(values) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        for metrics in micro_batches
    ]

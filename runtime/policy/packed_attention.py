"""Attention over packed rows with no T x T mask: memory that grows with the tokens.

A packed row holds several samples end to end, and each must attend causally to itself
only. Said with a dense additive mask that is T x T floats a row (1 GB at 16k tokens), and
it holds SDPA to its general masked kernel. Here the micro-batch's rows are laid end to end
as one sequence of segments, and attention runs once per segment on that segment's slice
with SDPA's causal kernel, which keeps no score matrix (flash on CPU and CUDA alike). A
segment is one sample, or one run of padding, which attends only to padding and is weighted
zero. Positions restart per sample, so a packed sample's logits are those of the sample run
alone. The cost is one kernel call a segment a layer, which is small beside the matmuls.

The function is registered with transformers' `AttentionInterface` as `PACKED_ATTENTION`,
and HF models are loaded under that name, so every attention layer of a model class that
takes the interface calls it. The segments travel as a keyword of the forward call, which
transformers hands down to each layer (and to the recomputation of activation
checkpointing, which replays the same call). The name has no mask function registered, so
transformers builds no mask at all; a micro-batch without packed rows passes no segments
and gets transformers' SDPA on its causal path (a sliding-window layer's band mask is built
here then, a row's square, as transformers would build it for SDPA).

A model whose layers never call the interface, or call it without the keyword, would let
samples see each other; `PackedSegments.taken` and `_PACKED_FORWARD` turn that into an
error, and `check_packed_attention` refuses such a class before Ray starts.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from sft_runtime.runtime.errors import UserInputError

PACKED_ATTENTION = "sft_packed_sdpa"
SEGMENTS_KWARG = "sft_segments"
_PACKED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sft_packed_forward", default=False
)


class PackedSegments:
    """The (start, end) slices of the flattened micro-batch, and how many attention calls
    took them (zero after a forward means the model never used them).

    A plain class, not a dataclass: FSDP2's cast of forward inputs rebuilds every dataclass
    it meets in the keywords, and the copy's count would never reach the caller."""

    __slots__ = ("bounds", "taken")

    def __init__(self, bounds: tuple[tuple[int, int], ...]) -> None:
        self.bounds = bounds
        self.taken = 0


def segment_bounds(segment_ids: torch.Tensor) -> PackedSegments:
    """Slices of ``segment_ids`` (batch, T) laid end to end: a new slice wherever the id
    changes or a row starts, so no slice crosses a sample or a row."""
    batch, width = segment_ids.shape
    flat = segment_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::width] = True
    cut = torch.nonzero(starts).flatten().tolist() + [batch * width]
    return PackedSegments(tuple(zip(cut[:-1], cut[1:], strict=True)))


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, T, dim) in, (batch, T, heads, dim)
    out. Segments given: causal SDPA per segment; none: transformers' own SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments: PackedSegments | None = kwargs.pop(SEGMENTS_KWARG, None)
    window = kwargs.pop("sliding_window", None)
    if segments is None:
        if _PACKED_FORWARD.get():
            raise RuntimeError(
                f"{type(module).__name__} called attention without the packed segments (the "
                "model drops attention keywords), so packed samples would see each other: "
                "set policy.sequence_packing.enabled=false"
            )
        if attention_mask is None:  # transformers builds none for this name: the window's own
            attention_mask = _window_mask(query.shape[2], window, query.device)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    segments.taken += 1
    outs = []
    for start, end in segments.bounds:
        mask = _window_mask(end - start, window, query.device)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            mask,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
        outs.append(out)
    return torch.cat(outs, dim=1), None


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """A sliding-window layer's (1, 1, L, L) mask for a segment longer than its window (a
    sample's own square, never the row's); None where plain causal attention is the same."""
    if window is None or length <= window:
        return None
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return ((k <= q) & (q - k < window))[None, None]


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    """While a packed micro-batch runs forward: an attention call without segments is an error."""
    token = _PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _PACKED_FORWARD.reset(token)


def register_packed_attention() -> str:
    """Register `packed_sdpa` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)
    return PACKED_ATTENTION


def check_packed_attention(config: Any, hf_path: str) -> None:
    """Refuse, before any worker loads it, a model class that does not route attention
    through transformers' interface: packed samples would silently see each other."""
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return  # an unknown class is refused with its own message where it is loaded
    if not getattr(model_class, "_supports_attention_backend", False):
        raise UserInputError(
            f"policy.model_name {hf_path!r}: {model_class.__name__} does not take "
            "transformers' attention interface, so packed rows cannot keep their samples "
            "apart: set policy.sequence_packing.enabled=false"
        )

"""A pretrained Hugging Face causal LM as the policy: loading, packed forward, its own folder.

The model is the `transformers` model itself, not a wrapper around it, so its parameter names
(and with them every checkpoint) are the names `from_pretrained` expects. What sft-runtime
adds lives in functions around it:

- `load_hf_model` loads in float32 whatever dtype the folder stores (bf16 on the hub): the
  training dtype is the config's (`policy.precision`), and a float32 master copy is what
  AdamW needs. A folder whose weights do not cover the model is refused: transformers would
  fill the gap with fresh random weights and only warn.
- `hf_logits` runs packed rows through `packed_attention` (the model is loaded with it for
  SDPA): the rows laid end to end, attention once per sample, no T x T tensor anywhere, and
  positions that restart per sample, so a packed sample's logits are those of the sample
  alone. Rows of one sample each take transformers' own causal path. A model loaded with
  eager attention (only ever unpacked in a run; the config refuses eager with packing)
  still takes `packed_attention_mask`, the dense reference the tests hold the new path to.
- `hf_state_dict` drops tied duplicates (the LM head that *is* the embedding), as
  `save_pretrained` does, and `write_hf_config` adds ``config.json`` and
  ``generation_config.json``, so a checkpoint's weights folder is a model folder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy.model_path import is_local
from sft_runtime.runtime.policy.packed_attention import (
    PACKED_ATTENTION,
    SEGMENTS_KWARG,
    PackedSegments,
    packed_forward,
    register_packed_attention,
    segment_bounds,
)

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def load_hf_model(
    path: str, *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The pretrained model in float32 (or ``dtype``: a frozen LoRA base), every weight from
    the folder (see module docstring). SDPA is loaded as `PACKED_ATTENTION`, which is SDPA
    itself for rows of one sample."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per worker per load is noise in a run's log
    if attn_implementation == "sdpa":
        attn_implementation = register_packed_attention()
    model, info = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=is_local(path),
        output_loading_info=True,
    )
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or ())
    if missing or mismatched:
        shown = ", ".join([*missing, *mismatched][:5])
        raise UserInputError(
            f"policy.model_name {path!r}: the folder's weights do not match the model "
            f"({len(missing)} missing, {len(mismatched)} of another shape: {shown}); "
            "transformers would train a freshly initialised model instead"
        )
    return model


def packed_attention_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive (batch, 1, T, T) mask: 0 where query t may see key s (same sample, s <= t),
    the dtype's minimum elsewhere. Padding (-1) sees padding, so no row is fully closed."""
    t = segment_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def hf_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    packed: bool = True,
) -> torch.Tensor:
    """Logits (batch, T, vocab) of packed rows, each sample attending to itself only;
    ``packed=False`` when no row holds more than one sample (padding only at row ends)."""
    positions = position_ids.clamp(min=0)
    if packed and model.config._attn_implementation == PACKED_ATTENTION:
        return _segmented_logits(model, input_ids, positions, segment_bounds(segment_ids))
    if packed:
        mask = packed_attention_mask(segment_ids, torch.float32)
    else:
        mask = (segment_ids >= 0).long()
    out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=False)
    return out.logits


def _segmented_logits(
    model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, segments: PackedSegments
) -> torch.Tensor:
    """The rows as one sequence of segments (see `packed_attention`), back in rows after."""
    batch, width = input_ids.shape
    with packed_forward():
        out = model(
            input_ids=input_ids.reshape(1, -1),
            position_ids=positions.reshape(1, -1),
            use_cache=False,
            **{SEGMENTS_KWARG: segments},
        )
    if not segments.taken:
        raise RuntimeError(
            f"{type(model).__name__} ran without calling its attention through transformers' "
            "interface, so packed samples could see each other: set "
            "policy.sequence_packing.enabled=false"
        )
    return out.logits.reshape(batch, width, -1)


def own_names(model: nn.Module) -> list[str]:
    """The ``state_dict`` names less tied duplicates: a parameter shared under two names (the
    LM head that *is* the embedding) keeps its first name only, as `save_pretrained` does."""
    shared = set(dict(model.named_parameters(remove_duplicate=False))) - set(
        dict(model.named_parameters())
    )
    return [name for name in model.state_dict() if name not in shared]


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own ``state_dict`` less tied duplicates (one storage is saved once)."""
    state = model.state_dict()
    return {name: state[name] for name in own_names(model)}


def load_hf_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load weights saved by `hf_state_dict`: only tied duplicates may be absent."""
    expected = set(model.state_dict())
    tied = expected - set(hf_state_dict(model))
    missing = expected - set(tensors) - tied
    unexpected = set(tensors) - expected
    if missing or unexpected:
        raise UserInputError(
            "checkpoint weights do not match the model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(tensors, strict=False)


def write_hf_config(model: nn.Module, directory: str | Path, *, dtype: torch.dtype) -> list[str]:
    """``config.json`` (saying the stored ``dtype``) and ``generation_config.json``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.__class__.from_dict(model.config.to_dict())  # a copy to edit
    config.dtype = dtype
    config.save_pretrained(out)
    written = [str(out / "config.json")]
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out)
        written.append(str(out / "generation_config.json"))
    return written

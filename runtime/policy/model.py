"""The policy model: a small decoder-only transformer that understands packed rows (or, with
``policy.model_name``, a pretrained Hugging Face model: `runtime.policy.hf_model`).

A row may hold several packed samples (``segment_ids`` 0, 1, ...) and padding (-1). Each
token attends causally to earlier tokens of its own segment only, so a packed sample gives
the same logits as when it sits alone in a row; positions come from ``position_ids``, which
restart at 0 for every segment. Padding attends to padding before it (never an empty row in
the mask, so no NaNs) and its outputs are never used by the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sft_runtime.runtime.data.batch import SFTBatch
from sft_runtime.runtime.policy.config import ModelConfig


def attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (batch, 1, T, T) mask, True where query t may attend to key s.

    Causal and block-diagonal over segments; the diagonal is always allowed, so every query
    has at least one key.
    """
    t = segment_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


class _Block(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        # no bias: a key bias gets no gradient (softmax ignores it) and Adam turns its
        # rounding noise into updates
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyTransformer(nn.Module):
    """Decoder-only LM: token + learned position embeddings, pre-norm blocks, an LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # policy.dtensor_cfg.activation_checkpointing: recompute each block in the backward pass
        self.checkpoint_blocks = False

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (batch, T, vocab) for every position."""
        if input_ids.shape[-1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {input_ids.shape[-1]} exceeds "
                f"policy.model.max_seq_len={self.cfg.max_seq_len}"
            )
        mask = attention_mask(segment_ids)
        x = self.drop(self.tok(input_ids) + self.pos(position_ids.clamp(min=0)))
        for block in self.blocks:
            if self.checkpoint_blocks and self.training:
                x = checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        return self.head(self.ln_f(x))


def build_model(
    cfg: ModelConfig,
    model_name: str | None = None,
    *,
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The pretrained HF causal LM in the folder ``model_name`` (``policy.model_name``), or
    with none our transformer of ``policy.model``'s sizes; a pretrained model's
    parameters are ``dtype`` (a frozen LoRA base may be stored in bfloat16).
    ``sharded`` (FSDP): an HF model comes as a skeleton whose parameters are on the meta
    device, to be filled with this rank's slices once sharded (`hf_shards`), wherever its
    folder can be read in slices."""
    if model_name is not None:
        from sft_runtime.runtime.policy import hf_shards
        from sft_runtime.runtime.policy.hf_model import load_hf_model

        attn = cfg.attn_implementation
        if sharded and hf_shards.can_slice(model_name):
            return hf_shards.skeleton(model_name, attn_implementation=attn, dtype=dtype)
        return load_hf_model(model_name, attn_implementation=attn, dtype=dtype)
    return TinyTransformer(cfg)


def forward_logits(model: nn.Module, mb: SFTBatch) -> torch.Tensor:
    """Logits of a micro-batch's rows for either kind of model (an HF model takes keyword
    inputs and the mask as a tensor; ours builds its mask from the segment ids)."""
    if isinstance(model, TinyTransformer):
        return model(mb.input_ids, mb.position_ids, mb.segment_ids)
    from sft_runtime.runtime.policy.hf_model import hf_logits

    return hf_logits(model, mb.input_ids, mb.position_ids, mb.segment_ids, packed=mb.packed)

"""Greedy replies of a Hugging Face chat model folder, as a user of transformers gets them.

The demo shows what fine-tuning changed by asking the same prompts of the base model and of
the exported checkpoint; both are plain model folders, so both are asked the plain way:
``apply_chat_template(..., add_generation_prompt=True)`` then ``generate`` with sampling off.
Greedy decoding makes the before/after pair the same on every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def greedy_replies(
    model_dir: Path | str, prompts: Sequence[str], max_new_tokens: int = 32
) -> list[str]:
    """One greedy reply per single-turn `prompts` entry, special tokens left out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, local_files_only=True
    ).eval()
    replies = []
    for prompt in prompts:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        reply = out[0, inputs["input_ids"].shape[1] :]
        replies.append(tokenizer.decode(reply, skip_special_tokens=True).strip())
    return replies

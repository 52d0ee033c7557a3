"""Tiny Hugging Face chat models built offline, for tests that need the real thing.

There is no model hub on the machines the suite runs on, so everything a test would
download is built here in well under a second: a byte-level BPE tokenizer trained on the
demo conversations, a chat template written to mimic a real family's layout, and a
two-layer Llama or Qwen2 with random weights. The layouts are chosen to reproduce the
traps real templates set for SFT masking:

- ``"chatml"`` (Qwen style): no BOS, eos ``<|im_end|>``, a default system prompt injected
  when the conversation has none, and ``{% generation %}`` markers around each assistant
  reply plus its ``<|im_end|>``, so ``return_assistant_tokens_mask`` works.
- ``"llama3"`` (Llama-3 style): the template emits ``{{ bos_token }}`` itself while the
  tokenizer also adds BOS on plain ``encode`` (the double-BOS trap), contents are
  ``| trim``-med, a dated system header is injected when there is no system message, and
  there are no generation markers, so assistant spans must come from prefix renders.
- ``"none"``: the ChatML special tokens but no chat template at all.
- ``"qwen3"``: Qwen3's stock template, verbatim (tests/support/qwen3_template.py), over the
  ChatML special tokens plus ``<think>`` and ``</think>`` as added tokens that are not
  special, as in Qwen3's tokenizer. It re-renders earlier assistant turns without their
  think block once a later user message exists, and has no generation markers.
- ``"gemma"`` (Gemma style): the template emits ``{{ bos_token }}`` (the tokenizer adds BOS
  on plain ``encode`` too), the assistant role is rendered as ``model``, turns close with
  ``<end_of_turn>`` (the eos, so the supervised span ends with what generation stops on),
  no generation markers, and a system message is refused with ``raise_exception`` (the
  record passes the data checks: only a render finds it).

Everything is saved as on the hub: tokenizer files beside ``config.json`` in one folder.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from sft_runtime.runtime.data.demo import demo_conversation
from tests.support.qwen3_template import QWEN3_TEMPLATE

CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n"
    "Cutting Knowledge Date: December 2023<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- raise_exception('System role not supported') -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<start_of_turn>model\\n' -}}"
    "{%- endif -%}"
)

# The pre-tokenizer regexes of the real tokenizer.json files: Qwen2 splits digits one by one,
# Llama 3 in groups of up to three.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"\p{L}+|\p{N}|", r"\p{L}+|\p{N}{1,3}|")

# Per layout: its Jinja source (None: no template), the special tokens in id order, which of
# them are BOS / EOS / PAD (Llama 3 ships without a PAD token; so does this copy), the
# pre-tokenizer, and the tokenizer class its tokenizer_config.json names, as on the hub (for
# model type qwen2 transformers uses Qwen2Tokenizer whatever the file says, so a tokenizer
# folder copied without config.json only loads the same way when the file names it too).
_CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
# Gemma's ids start <pad>, <eos>, <bos>; its turn markers come later in the real vocabulary.
_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
_CHATML_ROLES = {
    "bos": None,
    "eos": "<|im_end|>",
    "pad": "<|endoftext|>",
    "split": QWEN2_SPLIT,
    "class": "Qwen2Tokenizer",
}
TEMPLATES: dict[str, dict[str, Any]] = {
    "chatml": {"jinja": CHATML_TEMPLATE, "specials": _CHATML_SPECIALS, **_CHATML_ROLES},
    "llama3": {
        "jinja": LLAMA3_TEMPLATE,
        "specials": _LLAMA3_SPECIALS,
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": None,
        "split": LLAMA3_SPLIT,
        "class": "PreTrainedTokenizerFast",
    },
    "none": {"jinja": None, "specials": _CHATML_SPECIALS, **_CHATML_ROLES},
    "gemma": {
        "jinja": GEMMA_TEMPLATE,
        "specials": _GEMMA_SPECIALS,
        "bos": "<bos>",
        "eos": "<end_of_turn>",
        "pad": "<pad>",
        "split": LLAMA3_SPLIT,
        "class": "PreTrainedTokenizerFast",
    },
}
# Qwen3's own template over the ChatML specials, with <think> and </think> added (not special).
TEMPLATES["qwen3"] = {
    "jinja": QWEN3_TEMPLATE,
    "specials": _CHATML_SPECIALS,
    "added": ["<think>", "</think>"],
    **_CHATML_ROLES,
}
DEFAULT_TEMPLATE = {"llama": "llama3", "qwen2": "chatml"}


def demo_texts(count: int = 200, seed: int = 0) -> list[str]:
    """Demo conversations as plain ``role: content`` lines: what the BPE merges are learned
    from, so the test conversations tokenize into multi-byte tokens as real text does."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        lines = [f"{m['role']}: {m['content']}" for m in demo_conversation(rng)]
        texts.append("\n".join(lines))
    return texts


def train_tokenizer(
    out_dir: str | Path, texts: Iterable[str], *, template: str, vocab_size: int = 512
):
    """Train a byte-level BPE on `texts`, wrap it as a transformers tokenizer with the
    `template` layout's special tokens and chat template, and save it to `out_dir`.

    Returns ``AutoTokenizer.from_pretrained(out_dir)``: what a user of the folder gets.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
    layout = TEMPLATES[template]
    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(layout["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=layout["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer)
    # Untrimmed offsets, as the Llama 3 and Qwen2 tokenizer.json files have: whitespace
    # tokens keep their characters, so character spans map onto tokens exactly.
    byte_level = processors.ByteLevel(trim_offsets=False)
    if layout["bos"] is None:
        core.post_processor = byte_level
    else:  # like Llama 3's tokenizer.json: plain `encode` prepends BOS
        bos = layout["bos"]
        adds_bos = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, core.token_to_id(bos))],
        )
        core.post_processor = processors.Sequence([byte_level, adds_bos])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=layout["bos"],
        eos_token=layout["eos"],
        pad_token=layout["pad"],
        clean_up_tokenization_spaces=False,
    )
    wrapped.add_tokens(layout.get("added", []))  # not special, as Qwen3's <think>
    wrapped.chat_template = layout["jinja"]
    wrapped.save_pretrained(str(out_dir))
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = layout["class"]
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return AutoTokenizer.from_pretrained(str(out_dir))


TINY = {  # two small layers with grouped-query attention: every family's tiny test size
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def tiny_model(config_cls: Any, model_cls: Any, *, seed: int = 0, **config: Any) -> Any:
    """A model of ``model_cls`` at the `TINY` sizes (``config`` adds or overrides keys), its
    weights drawn from ``seed`` without touching the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config_cls(**{**TINY, **config}))


def build_model(
    out_dir: str | Path,
    *,
    family: str,
    vocab_size: int,
    max_positions: int = 256,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    """Save a two-layer ``LlamaForCausalLM`` (`family` "llama") or ``Qwen2ForCausalLM``
    ("qwen2") with weights drawn under `seed`, stored in `dtype` (hub checkpoints are bf16,
    which loaders must not silently keep), and a ``generation_config.json`` with the ids.

    The global torch RNG is left as it was. Returns the model (in `dtype`).
    """
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if family not in classes:
        raise ValueError(f"family must be one of {sorted(classes)}, got {family!r}")
    config_cls, model_cls = classes[family]
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    model = tiny_model(
        config_cls,
        model_cls,
        seed=seed,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        **ids,
    )
    model = model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(str(out_dir))
    return model


def hf_model_dir(
    out_dir: str | Path,
    *,
    family: str = "llama",
    template: str | None = None,
    dtype: torch.dtype = torch.float32,
    texts: Iterable[str] | None = None,
) -> Path:
    """A hub-like model folder: tokenizer (`template`, by default the family's own layout)
    and a tiny model whose vocabulary is exactly the tokenizer's ``len(tokenizer)``."""
    if family not in DEFAULT_TEMPLATE:
        raise ValueError(f"family must be one of {sorted(DEFAULT_TEMPLATE)}, got {family!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(
        out, demo_texts() if texts is None else texts, template=template or DEFAULT_TEMPLATE[family]
    )
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    build_model(
        out,
        family=family,
        vocab_size=len(tok),
        dtype=dtype,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=pad,
    )
    return out

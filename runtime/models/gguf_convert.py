"""A GGUF file turned into a plain Hugging Face model folder, the Hugging Face way.

transformers reads GGUF (with the ``gguf`` package installed) and dequantizes every tensor
while loading, so ``from_pretrained(..., gguf_file=...)`` gives an ordinary model and
tokenizer, chat template included. It still marks the model as quantized, and
`save_pretrained` refuses a quantized model it cannot serialize. Asked to dequantize
(transformers would otherwise keep the blocks packed where a GGUF matmul kernel is
installed) and with the marker gone (``config.quantization_config`` and ``hf_quantizer``),
the weights, dense by then, are saved as safetensors in `dtype`, and the folder reloads with
no trace of GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sft_runtime.runtime.errors import UserInputError

DEMO_EXTRA = "pip install 'sft-runtime[demo]'  (the gguf package)"


@dataclass(frozen=True)
class Converted:
    """What `convert_gguf` wrote."""

    architecture: str
    parameters: int
    vocab_size: int


def require_gguf() -> None:
    """transformers needs the ``gguf`` package to read GGUF files: say how to get it."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserInputError(f"reading a GGUF model needs the gguf package: {DEMO_EXTRA}") from None


def convert_gguf(gguf_path: Path, out: Path, dtype: str = "bfloat16") -> Converted:
    """Load `gguf_path` with transformers and save model and tokenizer into `out`."""
    require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # dense weights whatever kernels are installed: a packed GGUF layer cannot be saved
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserInputError(f"{gguf_path}: its tokenizer has no chat template")
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Converted(
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=len(tokenizer),
    )

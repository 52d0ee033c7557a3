"""Turn JSONL conversations into an energon data set (WebDataset tars + ``.nv-meta``).

Every line is validated before a single shard is written, so a bad file never leaves a half
prepared data set behind. Samples are stored as a ``json`` part holding the normalized
``{"messages": [...]}``, mapped by ``dataset.yaml`` onto
`sft_runtime.runtime.data.sample.ChatSample`.
The train/val split is decided per sample (seeded), and each split gets its own shard
files, because energon's ``--split-ratio`` splits whole shards and would give an empty or
oversized val split for small inputs; energon's own preparation then indexes the shards
with one pattern per split.
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from sft_runtime.runtime.data.records import BadRecordError, parse_line
from sft_runtime.runtime.errors import UserInputError

DATASET_YAML = """\
sample_type:
  __module__: sft_runtime.runtime.data.sample
  __class__: ChatSample
field_map:
  messages: json[messages]
"""
SPLITS = ("train", "val")
#: Inputs larger than this many bytes get a progress bar.
PROGRESS_MIN_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class PrepareResult:
    """What `prepare_jsonl` wrote: counts per split and the lines it skipped."""

    out_dir: Path
    num_train: int
    num_val: int
    skipped_lines: list[int]
    num_shards: int


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
    samples: Iterable[tuple[str, str, list[dict[str, str]]]],
    *,
    shard_size: int,
) -> dict[str, int]:
    """Write (split, key, messages) samples as ``<split>-NNNNNN.tar`` shards; counts per split."""
    import webdataset

    if shard_size < 1:
        raise UserInputError(f"--shard-size must be >= 1, got {shard_size}")
    out_dir.mkdir(parents=True, exist_ok=True)
    writers: dict[str, webdataset.ShardWriter] = {}
    counts = dict.fromkeys(SPLITS, 0)
    try:
        for split, key, messages in samples:
            if split not in writers:
                pattern = str(out_dir / f"{split}-%06d.tar")
                # A fixed mtime makes the same input give byte-identical shards.
                writers[split] = webdataset.ShardWriter(
                    pattern, maxcount=shard_size, verbose=0, mtime=0
                )
            payload = orjson.dumps({"messages": messages})
            writers[split].write({"__key__": key, "json": payload})
            counts[split] += 1
    finally:
        for writer in writers.values():
            writer.close()
    return counts


def energon_prepare(out_dir: Path, splits: Iterable[str]) -> None:
    """Index the shards with energon's own preparation and write ``.nv-meta/dataset.yaml``.

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
    (out_dir / ".nv-meta" / "dataset.yaml").write_text(DATASET_YAML)


def _progress(total: int, label: str):
    """A rich progress bar for big inputs, a no-op context otherwise."""
    if total < PROGRESS_MIN_BYTES:
        return contextlib.nullcontext(lambda n: None)
    from rich.progress import Progress

    @contextlib.contextmanager
    def bar():
        with Progress(transient=True) as progress:
            task = progress.add_task(label, total=total)
            yield lambda n: progress.advance(task, n)

    return bar()


def prepare_jsonl(
    input_path: Path | str,
    out_dir: Path | str,
    *,
    shard_size: int = 1000,
    val_fraction: float = 0.0,
    skip_bad: bool = False,
    seed: int = 0,
) -> PrepareResult:
    """Validate `input_path` line by line and write it as an energon data set in `out_dir`.

    Raises `BadRecordError` (file and line) on the first bad line unless `skip_bad` is set,
    in which case the skipped line numbers are returned.
    """
    input_path, out_dir = Path(input_path), Path(out_dir)
    if not input_path.is_file():
        raise UserInputError(f"{input_path}: input file not found")
    if not 0.0 <= val_fraction < 1.0:
        raise UserInputError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    ensure_empty_out_dir(out_dir)
    source = str(input_path)
    total = input_path.stat().st_size

    good: list[int] = []
    skipped: list[int] = []
    with _progress(total, "checking") as advance:
        for line_no, raw in _iter_lines(input_path, advance):
            try:
                parse_line(raw, source=source, line_no=line_no)
            except BadRecordError:
                if not skip_bad:
                    raise
                skipped.append(line_no)
                continue
            good.append(line_no)
    if not good:
        raise UserInputError(f"{source}: no valid conversations")

    num_val = round(len(good) * val_fraction)
    if val_fraction > 0 and len(good) >= 2:
        num_val = min(max(num_val, 1), len(good) - 1)
    val_lines = set(random.Random(seed).sample(good, num_val))
    wanted = set(good)

    def samples() -> Iterator[tuple[str, str, list[dict[str, str]]]]:
        with _progress(total, "writing") as advance:
            for line_no, raw in _iter_lines(input_path, advance):
                if line_no in wanted:
                    messages = parse_line(raw, source=source, line_no=line_no)
                    split = "val" if line_no in val_lines else "train"
                    yield split, sample_key(line_no), messages

    counts = write_shards(out_dir, samples(), shard_size=shard_size)
    splits = [split for split in SPLITS if counts[split] > 0]
    energon_prepare(out_dir, splits)
    return PrepareResult(
        out_dir=out_dir,
        num_train=counts["train"],
        num_val=counts["val"],
        skipped_lines=skipped,
        num_shards=len(list(out_dir.glob("*.tar"))),
    )

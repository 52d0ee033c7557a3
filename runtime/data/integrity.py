"""Checks that turn a broken or too small data set into a message naming the data set.

energon reports these deep inside a worker (an assertion about an empty data set, a tar
read error without the shard's name); these checks run when that happens, or cheaply up
front, so the user learns which file to fix.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import yaml

from sft_runtime.runtime.errors import UserInputError


class DataSetError(UserInputError):
    """The data set on disk is damaged, empty or too small for the run."""


class RefusedSampleError(DataSetError):
    """The chat template refused a sample of the data set (`data.skip_bad_samples` is off)."""


def refused_sample_error(data_path: Path, refused: list[tuple[str, str]]) -> RefusedSampleError:
    """One line naming the first refused sample of a batch, the template's words and the fix."""
    key, message = refused[0]
    more = f" (and {len(refused) - 1} more in this batch)" if len(refused) > 1 else ""
    return RefusedSampleError(
        f"data.train.path {str(data_path)!r}: sample {key!r}{more}: the chat template refuses "
        f"it ({message}); fix or remove it (`sft-runtime prepare-data --tokenizer DIR` checks "
        "a data set), or set data.skip_bad_samples=true to skip such samples"
    )


def split_shards(data_path: Path, split: str) -> list[str]:
    """The shard names of one split, from ``.nv-meta/split.yaml``."""
    from braceexpand import braceexpand

    try:
        parts = yaml.safe_load((data_path / ".nv-meta" / "split.yaml").read_text())
        patterns = parts["split_parts"][split]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return []
    return [name for pattern in patterns for name in braceexpand(pattern)]


def split_samples(data_path: Path, split: str) -> int | None:
    """Samples in one split, from energon's ``.nv-meta/.info.json`` (None if unknown)."""
    try:
        counts = json.loads((data_path / ".nv-meta" / ".info.json").read_text())["shard_counts"]
    except (OSError, KeyError, ValueError, TypeError):
        return None
    shards = split_shards(data_path, split)
    if not shards:
        return None
    return sum(int(counts.get(name, 0)) for name in shards)


def check_enough_samples(
    data_path: Path, split: str, logical_world_size: int, num_workers: int
) -> None:
    """Every loader worker of every DP rank needs at least one sample."""
    needed = logical_world_size * max(1, num_workers)
    have = split_samples(data_path, split)
    if have is not None and have < needed:
        raise DataSetError(
            f"data.train.path {str(data_path)!r} split {split!r} has {have} sample(s), too "
            f"few for {logical_world_size} data-parallel rank(s) x {max(1, num_workers)} "
            f"loader worker(s): every one needs at least one sample"
        )


def find_damaged_shard(data_path: Path, split: str) -> str | None:
    """'shard: reason' for the first shard of the split that cannot be read, else None."""
    for name in split_shards(data_path, split):
        path = data_path / name
        try:
            with tarfile.open(path, mode="r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    payload = tar.extractfile(member).read()
                    if member.name.endswith(".json"):
                        json.loads(payload)
        except (OSError, tarfile.TarError, ValueError, EOFError) as exc:
            return f"{path}: {type(exc).__name__}: {exc}"
    return None


def explain_load_error(data_path: Path, split: str, exc: BaseException) -> DataSetError | None:
    """A `DataSetError` describing why energon failed to deliver a batch, if the cause is
    the data set itself; None when the data set looks fine (the error is something else)."""
    damaged = find_damaged_shard(data_path, split)
    if damaged is not None:
        return DataSetError(
            f"data.train.path {str(data_path)!r}: damaged shard {damaged}; re-create the "
            "shard or prepare the data set again"
        )
    if "empty dataset" in str(exc):
        return DataSetError(
            f"data.train.path {str(data_path)!r} split {split!r}: a data-parallel rank got no "
            "samples; the data set is too small for the data-parallel size"
        )
    return None


#: The sample type's module in data sets prepared before the `sft_runtime` namespace.
_OLD_SAMPLE_MODULE = "runtime.data.sample"


def check_sample_type(data_path: Path) -> None:
    """A data set whose ``dataset.yaml`` names the sample type by its pre-namespace module
    would fail inside energon with an import error; say which file and line to change."""
    meta = data_path / ".nv-meta" / "dataset.yaml"
    try:
        spec = yaml.safe_load(meta.read_text())
        module = spec["sample_type"]["__module__"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return  # not ours to judge: energon reports its own format errors
    if module == _OLD_SAMPLE_MODULE:
        raise DataSetError(
            f"{meta}: sample_type.__module__ is {module!r}, the module's name before "
            "sft-runtime installed under the `sft_runtime` namespace; change it to "
            f"'sft_runtime.{module}' (or prepare the data set again)"
        )

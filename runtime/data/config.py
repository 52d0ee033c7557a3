"""The data section of the run config, and the flat spec one loader is built from.

The section models reject unknown keys so a typo in a YAML file is an error that names the key
instead of a silently ignored setting. `LoaderSpec` is what crosses the Ray boundary to the
worker that owns a loader: flat, frozen and picklable, with every value already resolved
(per-rank batch size, packing on or off), so the worker never needs the whole run config.

Epochs: ``train.virtual_epoch_length`` is the number of optimizer steps in one epoch. Each step
takes one batch from every logical rank's loader, so an epoch is that many consecutive batches
of each rank's endless energon stream (energon repeats and reshuffles the rank's share of the
data by itself, seeded). The loader counts epochs in committed steps rather than using energon's
``virtual_epoch_length``, which loses the worker order on resume with worker processes. With
``virtual_epoch_length x global batch == samples`` (and no shuffle buffer) each epoch covers the
data set exactly once.

Order (NeMo RL's ``data.shuffle``): with ``shuffle: true`` energon reads each worker's share
of the train split in a fresh seeded order of shard slices every epoch (up to 16 slices open at
once, samples drawn from them at random), then through a shuffle buffer of
``data.energon.shuffle_buffer_size`` samples (`DEFAULT_SHUFFLE_BUFFER` when the key is left
out; the buffer spans epoch boundaries, and one larger than a worker's share holds repeats).
With ``shuffle: false`` energon's slice shuffle is off too: each worker reads its share in
stored order, one slice after the other, the same order every epoch (with ``num_workers`` > 1
the batches come from the workers in turn).

``data.energon`` is this runtime's own section (NeMo RL has none), optional: its defaults
serve NeMo RL's configs. The loader's worker processes are NeMo RL's ``data.num_workers``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sft_runtime.runtime.data.chat_format import RENDERED_FORMAT, ChatFormat, read_prompt_file
from sft_runtime.runtime.data.data_defaults import fill_from_default
from sft_runtime.runtime.data.packing import PACKING_ALGORITHMS
from sft_runtime.runtime.data.placement import MAPPERS
from sft_runtime.runtime.data.record_shapes import DatasetName, RecordShape
from sft_runtime.runtime.data.tokenizer import TokenizerSpec
from sft_runtime.runtime.errors import UserInputError

TokenizerConfig = TokenizerSpec
"""The ``tokenizer`` section: ``name: byte`` (default) or ``name: DIR`` (NeMo RL's)."""

PackingAlgorithm = Literal[PACKING_ALGORITHMS]  # a tuple subscript lists its members
DATASET_NAMES = DatasetName.__args__  # NeMo RL's local-file data sets
OverlongPolicy = Literal["mask", "truncate", "drop"]
"""What happens to a sample longer than ``data.max_input_seq_length`` (see task_encoder.py)."""
DEFAULT_SHUFFLE_BUFFER = 256  # samples, with data.shuffle and no data.energon.shuffle_buffer_size
PROCESSORS = ("sft_processor",)  # NeMo RL's data.*.processor values built here
_FORMAT = ChatFormat()  # the defaults of data.add_bos, add_eos, add_generation_prompt


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class EnergonConfig(_Section):
    """Settings handed to energon's loader (per logical DP rank); optional (module doc)."""

    # left out: DEFAULT_SHUFFLE_BUFFER with data.shuffle, none without (DataConfig resolves it)
    shuffle_buffer_size: int | None = Field(None, ge=1)
    topology_mapper: Literal[MAPPERS] = "default"  # the placement plan's mappers

    @model_validator(mode="before")
    @classmethod
    def _no_packing_buffer(cls, data: Any) -> Any:
        if isinstance(data, dict) and "packing_buffer_size" in data:
            raise ValueError(
                "data.energon.packing_buffer_size: packing lays out each step's own "
                "conversations (policy.train_global_batch_size counts conversations, as in "
                "NeMo RL), so there is no packing buffer; remove the key"
            )
        if isinstance(data, dict) and "num_workers" in data:
            raise ValueError(
                "data.energon.num_workers: the loader's worker processes are NeMo RL's "
                "data.num_workers; move the value there"
            )
        return data


class ElasticConfig(_Section):
    """How the data is cut for a resume on another number of workers (runtime/data/shards.py).

    ``shards`` (G) is fixed when the run starts: G energon loaders, each the stream that rank
    v of G would read, and each step takes the same rows from every shard whatever the number
    of data-parallel workers W that trains them (W must divide G). Left out, G is the run's
    data-parallel size at its start, which is exactly the stream of a run without the key.
    """

    shards: int | None = Field(None, ge=1)


def check_processing(where: str, processor: Any, prompt_file: Any, system_prompt_file: Any) -> None:
    """The rules of NeMo RL's processing keys under `where` (``data.train``, ``data.default``):
    ``processor`` is only NeMo RL's SFT one; ``prompt_file`` must read as a prompt
    (chat_format.py); ``system_prompt_file`` is refused, since NeMo RL's sft_processor never
    reads it and a file taken without effect would mislead (ValueError, one line)."""
    if processor not in PROCESSORS:
        raise ValueError(
            f"{where}.processor {processor!r}: only NeMo RL's sft_processor (chat rows, loss "
            "on the assistant turns) is built here"
        )
    if system_prompt_file is not None:
        raise ValueError(
            f"{where}.system_prompt_file: NeMo RL's sft_processor does not read it (only its "
            "math and multiple-choice processors do); for a system message in every "
            "conversation of a data_path set data.train.system_prompt (or data.validation's)"
        )
    if prompt_file is not None:
        read_prompt_file(str(prompt_file), f"{where}.prompt_file")


class _DataFile(_Section):
    """Where samples come from: a prepared energon data set (``path``), or NeMo RL's local
    data file (``dataset_name`` with ``data_path`` and its record keys), which the run
    prepares itself (runtime/data/bring.py)."""

    path: str | None = None
    dataset_name: str | None = None
    data_path: str | None = None
    # how a line reads: NeMo RL's keys, with `RecordShape`'s (NeMo RL's) defaults
    chat_key: str = RecordShape.chat_key
    system_key: str | None = RecordShape.system_key
    system_prompt: str | None = RecordShape.system_prompt
    tool_key: str | None = RecordShape.tool_key  # null: the records' tools are not read
    input_key: str = RecordShape.input_key
    output_key: str = RecordShape.output_key
    # NeMo RL's processing keys (data.default usually holds them): see `check_processing`
    processor: str = PROCESSORS[0]
    prompt_file: str | None = None
    system_prompt_file: str | None = None

    def _check_processing(self, section: str) -> None:
        check_processing(
            f"data.{section}", self.processor, self.prompt_file, self.system_prompt_file
        )

    def prompt(self, section: str) -> str | None:
        """The text of ``prompt_file`` (None without one), read when a loader is set up."""
        if self.prompt_file is None:
            return None
        try:
            return read_prompt_file(self.prompt_file, f"data.{section}.prompt_file")
        except ValueError as exc:
            raise UserInputError(str(exc)) from None

    def _check_source(self, section: str) -> None:
        if self.dataset_name is not None and self.dataset_name not in DATASET_NAMES:
            raise ValueError(
                f"data.{section}.dataset_name {self.dataset_name!r}: a hub data set cannot be "
                "fetched here; bring it as a local JSONL file: dataset_name: openai_format "
                f"(a 'messages' list a line) or ResponseDataset, with data_path: FILE"
            )
        if self.data_path is not None and self.dataset_name is None:
            raise ValueError(
                f"data.{section}.data_path needs data.{section}.dataset_name: openai_format "
                "or ResponseDataset (how a line reads)"
            )
        if self.data_path is not None and self.path is not None:
            raise ValueError(
                f"data.{section}: path (a prepared data set) and data_path (a JSONL file) "
                "name two sources; keep one"
            )
        if self.data_path is None and self.path is None:
            given = "dataset_name without data_path" if self.dataset_name else "no source"
            raise ValueError(
                f"data.{section}: {given}; give data_path (a local JSONL file) or path (a "
                "prepared energon data set)"
            )

    def shape(self) -> RecordShape:
        """How a line of ``data_path`` reads."""
        keys = {f.name for f in fields(RecordShape)} - {"dataset_name"}
        name = self.dataset_name or RecordShape.dataset_name
        return RecordShape(dataset_name=name, **self.model_dump(include=keys))


class TrainDataConfig(_DataFile):
    """Where the training samples come from and how long an epoch is (in steps; by default
    one pass over the train split)."""

    split: str = "train"
    virtual_epoch_length: int | None = Field(None, ge=1)
    # NeMo RL's: the fraction of data_path's conversations held out as the validation split
    split_validation_size: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int | None = None  # what splits them (default: sft.seed)

    @model_validator(mode="after")
    def _check(self) -> TrainDataConfig:
        self._check_source("train")
        self._check_processing("train")
        # NeMo RL's split (split: "train") with a data_path selects nothing: the file is the
        # split, prepared as 'train' (bring.py), whatever the value says
        if self.split_validation_size and self.data_path is None:
            raise ValueError(
                "data.train.split_validation_size splits a data_path; a prepared data set "
                "(path) has its own splits: name one in data.validation"
            )
        return self


class ValidationDataConfig(_DataFile):
    """Optional validation data (a prepared data set's split, or a data file of its own)."""

    split: str = "val"

    @model_validator(mode="after")
    def _check(self) -> ValidationDataConfig:
        self._check_source("validation")
        self._check_processing("validation")
        return self


class DataConfig(_Section):
    """The ``data`` section of the run config.

    NeMo RL's ``data.default`` is a block of keys every data set entry takes where it sets
    none of its own; it is applied to ``train`` and ``validation`` as the config is read
    (data_defaults.py), so a loaded config holds each entry's resolved keys and no ``default``.
    """

    backend: Literal["energon"] = "energon"
    max_input_seq_length: int = Field(..., ge=2)
    # NeMo RL's switches on how a conversation becomes a row (chat_format.py)
    add_bos: bool = _FORMAT.add_bos
    add_eos: bool = _FORMAT.add_eos
    add_generation_prompt: bool = _FORMAT.add_generation_prompt
    shuffle: bool = True  # NeMo RL's; what it means with energon: module doc
    num_workers: int = Field(1, ge=0)  # NeMo RL's: the loader's worker processes
    train: TrainDataConfig
    energon: EnergonConfig = Field(default_factory=EnergonConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    validation: ValidationDataConfig | None = None
    # NeMo RL's rule by default: cut to the limit and weighted zero (counted, reported)
    overlong_samples: OverlongPolicy = "mask"
    # a sample the chat template refuses stops the run (False) or is skipped and counted
    skip_bad_samples: bool = False

    @model_validator(mode="before")
    @classmethod
    def _apply_default(cls, data: Any) -> Any:
        default = data.get("default") if isinstance(data, dict) else None
        if isinstance(default, dict):  # its values are named as data.default's, once
            check_processing(
                "data.default",
                default.get("processor", PROCESSORS[0]),
                default.get("prompt_file"),
                default.get("system_prompt_file"),
            )
        entries = {"train": TrainDataConfig, "validation": ValidationDataConfig}
        return fill_from_default(data, {k: set(m.model_fields) for k, m in entries.items()})

    @model_validator(mode="after")
    def _resolve_shuffle(self) -> DataConfig:
        energon = self.energon
        given = "shuffle_buffer_size" in energon.model_fields_set
        if not self.shuffle and energon.shuffle_buffer_size is not None:
            raise ValueError(
                "data.energon.shuffle_buffer_size: a shuffle buffer shuffles, and data.shuffle "
                "is false; remove one of them"
            )
        if self.shuffle and not given:
            self.energon = energon.model_copy(
                update={"shuffle_buffer_size": DEFAULT_SHUFFLE_BUFFER}
            )
        return self

    @property
    def chat_format(self) -> ChatFormat:
        return ChatFormat(
            add_bos=self.add_bos,
            add_eos=self.add_eos,
            add_generation_prompt=self.add_generation_prompt,
        )


class SequencePackingConfig(_Section):
    """Whether and how samples are packed into rows of ``max_input_seq_length`` tokens."""

    enabled: bool = False
    algorithm: PackingAlgorithm = "modified_first_fit_decreasing"
    max_sequences_per_bin: int | None = Field(None, ge=1)
    # Tokens over the mean a row may take under balanced_greedy_knapsack (see packing.py).
    balanced_knapsack_delta: int = Field(0, ge=0)
    # NeMo RL's tokens per packed micro-batch; here a micro-batch is train_micro_batch_size
    # rows of max_input_seq_length, so only that product is taken (null: the same)
    train_mb_tokens: int | None = Field(None, ge=1)
    # NeMo RL's padding of each packed sample (for its fused kernels): padding changes no
    # loss here, where rows are padded whole (policy.make_sequence_length_divisible_by)
    sequence_length_round: int = Field(64, ge=1)


class LoaderSpec(BaseModel):
    """Everything one colocated loader needs, resolved and flat (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_path: str
    split: str = "train"
    batch_size: int = Field(..., ge=1)
    seed: int = 0
    shuffle: bool = True  # False: energon's stored order (see module docstring)
    shuffle_buffer_size: int | None = None
    num_workers: int = Field(0, ge=0)  # data.num_workers
    max_input_seq_length: int = Field(..., ge=2)
    pad_multiple: int = Field(1, ge=1)
    packing_algorithm: PackingAlgorithm | None = None
    max_sequences_per_bin: int | None = Field(None, ge=1)
    balanced_knapsack_delta: int = Field(0, ge=0)
    only_unmask_final: bool = False
    virtual_epoch_length: int = Field(0, ge=0)
    tokenizer: TokenizerSpec = TokenizerSpec()
    overlong_samples: OverlongPolicy = "mask"
    skip_bad_samples: bool = False
    chat_format: ChatFormat = RENDERED_FORMAT  # the config's, from build_loader_spec
    prompt: str | None = None  # data.train.prompt_file's text

    @property
    def packing(self) -> bool:
        return self.packing_algorithm is not None


def build_loader_spec(
    data: DataConfig,
    *,
    global_batch_size: int,
    logical_world_size: int,
    seed: int = 0,
    packing: SequencePackingConfig | None = None,
    tokenizer: TokenizerSpec | None = None,
    make_sequence_length_divisible_by: int = 1,
    only_unmask_final: bool = False,
) -> LoaderSpec:
    """Resolve the config sections into the spec every logical rank's loader is built from.

    The global batch, in conversations, is split evenly over the logical DP ranks; with
    ``sequence_packing.enabled`` each rank packs its conversations of a step into rows.
    """
    if logical_world_size < 1:
        raise UserInputError(f"logical DP world size must be >= 1, got {logical_world_size}")
    if global_batch_size < 1 or global_batch_size % logical_world_size:
        raise UserInputError(
            f"policy.train_global_batch_size ({global_batch_size}) must be a positive multiple "
            f"of the data-parallel size ({logical_world_size})"
        )
    packing = packing or SequencePackingConfig()
    per_rank = global_batch_size // logical_world_size
    algorithm = packing.algorithm if packing.enabled else None
    assert algorithm is None or algorithm in PACKING_ALGORITHMS
    return LoaderSpec(
        data_path=data.train.path,
        split=data.train.split,
        batch_size=per_rank,
        seed=seed,
        shuffle=data.shuffle,
        shuffle_buffer_size=data.energon.shuffle_buffer_size,
        num_workers=data.num_workers,
        max_input_seq_length=data.max_input_seq_length,
        pad_multiple=make_sequence_length_divisible_by,
        packing_algorithm=algorithm,
        max_sequences_per_bin=packing.max_sequences_per_bin,
        balanced_knapsack_delta=packing.balanced_knapsack_delta,
        only_unmask_final=only_unmask_final,
        virtual_epoch_length=data.train.virtual_epoch_length,
        tokenizer=tokenizer or TokenizerSpec(),
        overlong_samples=data.overlong_samples,
        skip_bad_samples=data.skip_bad_samples,
        chat_format=data.chat_format,
        prompt=data.train.prompt("train"),
    )

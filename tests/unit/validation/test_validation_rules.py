"""Validation settings a run cannot keep are refused before Ray starts, naming the key; the
log's story of validations is checked like its steps, and re-executed ones are compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sft_runtime.events import open_log
from sft_runtime.events.errors import LineageError
from sft_runtime.events.lineage import compare_reexecutions, records_in_effect
from sft_runtime.events.schemas import RunStarted, ValidationCompleted
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.runtime.config import validate_config
from sft_runtime.runtime.config_files.overrides import apply_override
from sft_runtime.runtime.data.demo import build_demo_dataset
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.validation.config import validation_schedule, validation_spec
from tests.support.logbuild import PLACEMENT, step_event
from tests.support.small_run import small_raw


@pytest.fixture(scope="module")
def val_data(tmp_path_factory) -> Path:
    return build_demo_dataset(tmp_path_factory.mktemp("val") / "d", 32, val_samples=8)


def _raw(data: Path, *overrides: str) -> dict:
    raw = small_raw(Path("/tmp/run"), data)
    for item in overrides:
        apply_override(raw, item)
    return raw


def _refused(raw: dict) -> str:
    with pytest.raises(UserInputError) as err:
        validate_config(raw)
    return str(err.value)


def test_a_validation_split_that_does_not_exist_is_refused_naming_it(val_data):
    raw = _raw(
        val_data,
        f"data.validation.path={val_data}",
        "data.validation.split=test",
        "sft.val_period=2",
    )
    assert "data.validation.split 'test'" in _refused(raw)


def test_a_validation_path_that_is_no_data_set_is_refused(tmp_path, val_data):
    raw = _raw(val_data, f"data.validation.path={tmp_path}", "sft.val_period=2")
    assert "data.validation.path" in _refused(raw)


def test_a_validation_batch_that_does_not_split_over_the_ranks_is_refused(val_data):
    raw = _raw(
        val_data,
        f"data.validation.path={val_data}",
        "sft.val_period=2",
        "sft.val_global_batch_size=6",  # 2 ranks x micro 2 = 4 does not divide 6
        "sft.val_micro_batch_size=2",
    )
    assert "sft.val_global_batch_size=6 must be a multiple of data-parallel size 2" in _refused(raw)


def test_the_cli_refuses_it_with_exit_2_before_ray(val_data, tmp_path, capsys):
    raw = _raw(val_data, "sft.val_period=2")  # no data.validation
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert cli_main(["train", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "sft.val_period is set but data.validation is null" in err
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_the_spec_and_when_validation_is_due(val_data):
    config = validate_config(
        _raw(
            val_data,
            f"data.validation.path={val_data}",
            "sft.val_period=3",
            "sft.val_at_end=true",
            "sft.val_batches=2",
            "sft.val_global_batch_size=4",
            "checkpointing.metric_name=val:val_loss",
        )
    )
    spec = validation_spec(config)
    assert spec.num_samples == 8 and spec.global_batch_size == 4 and spec.micro_batch_size == 2
    due = [s for s in range(8) if validation_schedule(config).due(s, final=s == 7)]
    assert due == [3, 6, 7]  # not at the start without val_at_start
    whole = validation_spec(
        validate_config(
            _raw(
                val_data,
                f"data.validation.path={val_data}",
                "sft.val_at_start=true",
                "sft.val_batches=0",
            )
        )
    )
    assert whole.num_samples is None  # 0: the whole split


def _val(step: int, loss: float) -> ValidationCompleted:
    return ValidationCompleted(step=step, loss=loss, tokens=10, samples=4, sample_digest="d")


def test_a_validation_is_checked_and_rolled_back_like_a_step(tmp_path):
    log = open_log(tmp_path)
    log.append(RunStarted(placement_hash=PLACEMENT))
    log.append(_val(0, 2.0))
    for step in (1, 2):
        log.append(step_event(step))
    log.append(_val(2, 1.5))
    log.close()
    kept = [
        r.data["step"]
        for r in records_in_effect(tmp_path / "events.jsonl")
        if r.type == "validation_completed"
    ]
    assert kept == [0, 2]
    # a resume from step 0 rolls the validation of step 2 back, and re-runs it differently
    log = open_log(tmp_path)
    log.append(RunStarted(placement_hash=PLACEMENT, resumed_from_step=None))
    for step in (1, 2):
        log.append(step_event(step))
    log.append(_val(2, 1.25))
    log.close()
    compared, found = compare_reexecutions(tmp_path / "events.jsonl")
    assert compared == 3  # steps 1, 2 and the validation of step 2
    assert [(d.step, d.field, d.first_value, d.later_value) for d in found] == [
        (2, "val_loss", 1.5, 1.25)
    ]


def test_a_validation_out_of_step_order_is_refused_naming_the_line(tmp_path):
    log = open_log(tmp_path)
    log.append(RunStarted(placement_hash=PLACEMENT))
    log.append(step_event(1))
    log.append(_val(3, 1.0))
    log.close()
    with pytest.raises(LineageError, match="validation of step 3 completed after step 1"):
        list(records_in_effect(tmp_path / "events.jsonl"))

"""`logger.tensorboard_enabled`: refused before Ray when the extra is missing; otherwise every
step's metrics.jsonl numbers go to TensorBoard under the same keys, and a resume hides the
steps it rolled back."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.config import validate_config
from sft_runtime.runtime.config_files.overrides import apply_override
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.metrics.metrics_log import MetricsLogger, read_metrics
from sft_runtime.runtime.metrics.tensorboard_log import crc32c
from tests.support.small_run import small_raw

INSTALL = "pip install 'sft-runtime[tensorboard]'"


@pytest.fixture
def no_tensorboard(monkeypatch):
    """The interpreter as it is without the extra: find_spec finds no tensorboard."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )


def _raw(tensorboard: str) -> dict:
    raw = small_raw(Path("/tmp/run"), Path("/tmp/data"))
    apply_override(raw, f"logger.tensorboard_enabled={tensorboard}")
    return raw


def test_config_refuses_tensorboard_without_the_package(no_tensorboard):
    with pytest.raises(UserInputError) as info:
        validate_config(_raw("true"))
    assert f"logger.tensorboard_enabled: the tensorboard package is not installed: {INSTALL}" in (
        str(info.value)
    )
    assert validate_config(_raw("false")).logger.tensorboard_enabled is False


def test_config_accepts_tensorboard_when_installed():
    assert validate_config(_raw("true")).logger.tensorboard_enabled is True


def test_the_old_switch_is_refused_naming_nemo_rls_key():
    raw = small_raw(Path("/tmp/run"), Path("/tmp/data"))
    raw["logger"]["tensorboard"] = True
    with pytest.raises(UserInputError, match="turned on by logger.tensorboard_enabled: true"):
        validate_config(raw)


def test_train_exits_2_before_ray_without_the_package(
    no_tensorboard, tmp_path, monkeypatch, capsys
):
    import sft_runtime.runtime.launch.driver as driver

    def must_not_run(*args, **kwargs):
        raise AssertionError("Ray started although the config should have been refused")

    monkeypatch.setattr(driver, "run_training", must_not_run)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_raw(tmp_path / "run", tmp_path / "data")))
    assert main(["train", str(config), "logger.tensorboard_enabled=true"]) == 2
    err = capsys.readouterr().err
    assert f"logger.tensorboard_enabled: the tensorboard package is not installed: {INSTALL}" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_the_jsonl_keys_and_a_resume_hides_rolled_back_steps(tmp_path):
    # both attempts open their files in the same second: the later one's sorts after
    first = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(1, 6):  # attempt 1 gets to step 5, then crashes
        first.log(step, {"loss": float(step), "valid_tokens": 10 * step, "note": "x", "ok": True})
    first.close()
    second = MetricsLogger(tmp_path, tensorboard=True, first_step=4)  # resumed from step 3
    for step in range(4, 7):
        second.log(step, {"loss": step / 10, "valid_tokens": 100 * step})
    second.close()
    scalars = _scalars(tmp_path)
    assert set(scalars) == {"train/loss", "train/valid_tokens"}  # numbers only, jsonl's keys
    steps, losses = zip(*scalars["train/loss"], strict=True)
    assert steps == (1, 2, 3, 4, 5, 6)
    assert losses == pytest.approx((1.0, 2.0, 3.0, 0.4, 0.5, 0.6))  # float32 in the files
    assert scalars["train/valid_tokens"] == [
        (1, 10),
        (2, 20),
        (3, 30),
        (4, 400),
        (5, 500),
        (6, 600),
    ]
    rows = read_metrics(tmp_path / "metrics.jsonl")  # the jsonl keeps both attempts' lines
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 4, 5, 6]
    assert set(rows[0]["train"]) == {"loss", "valid_tokens", "note", "ok"}


def test_tensorboard_off_writes_no_event_files(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "train": {"loss": 1.0}}]


def test_the_record_checksum_is_crc32c():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(b"") == 0


def test_a_record_cut_short_by_a_crash_loses_that_step_alone(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        logger.log(step, {"loss": float(step)})
    logger.close()
    (events,) = (tmp_path / "tensorboard").iterdir()
    data = events.read_bytes()
    events.write_bytes(data[:-3])  # the last step's record, as a kill mid-write leaves it
    assert _scalars(tmp_path) == {"train/loss": [(1, 1.0), (2, 2.0)]}


def test_the_controller_process_writes_event_files_without_torch(tmp_path):
    code = (
        "import sys\n"
        "from sft_runtime.runtime.metrics.metrics_log import MetricsLogger\n"
        f"logger = MetricsLogger({str(tmp_path)!r}, tensorboard=True, first_step=3)\n"
        "logger.log(3, {'loss': 0.5})\n"
        "logger.close()\n"
        "print('torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "False"]
    assert _scalars(tmp_path) == {"train/loss": [(3, 0.5)]}

"""The ``logger`` section as NeMo RL writes it: its whole block loads; a backend turned on
without its package, SwanLab turned on, or an unknown key in a backend's block is refused
before Ray starts with one line that names the key (and the install command)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.config import validate_config
from sft_runtime.runtime.config_files.overrides import apply_override
from sft_runtime.runtime.errors import UserInputError
from tests.support.small_run import small_raw

HEADER = "config: invalid config"


@pytest.fixture(autouse=True)
def _no_tracking_env(monkeypatch):
    """MLflow's environment variable decides which store the check expects."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def hide(monkeypatch):
    """Makes packages look uninstalled to the config check (find_spec finds nothing)."""

    def _hide(*names: str) -> None:
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name in names else real(name)
        )

    return _hide


def _raw(*overrides: str) -> dict:
    raw = small_raw(Path("/tmp/run"), Path("/tmp/data"))
    for item in overrides:
        apply_override(raw, item)
    return raw


def _refusal(raw: dict) -> str:
    """The one line a refused config gets under the header."""
    with pytest.raises(UserInputError) as info:
        validate_config(raw)
    header, *lines = str(info.value).splitlines()
    assert header == HEADER
    assert len(lines) == 1, lines
    return lines[0].strip()


def test_nemo_rl_logger_section_loads_as_written():
    raw = _raw()
    raw["logger"] = {
        "log_dir": "logs",
        "wandb_enabled": True,
        "tensorboard_enabled": True,
        "mlflow_enabled": False,
        "swanlab_enabled": False,
        "monitor_gpus": True,
        "wandb": {"project": "sft-dev", "name": "sft-dev-squad"},
        "swanlab": {"project": "sft-dev", "name": "sft-dev-squad"},
        "tensorboard": {"log_dir": "tb_logs-sft-dev-squad"},
        "mlflow": {"experiment_name": "sft-dev", "run_name": "sft-dev-squad"},
        "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
    }
    logger = validate_config(raw).logger
    assert logger.wandb_enabled and logger.monitor_gpus and not logger.mlflow_enabled
    assert logger.wandb.project == "sft-dev" and logger.tensorboard.log_dir.startswith("tb_logs")
    assert logger.mlflow.experiment_name == "sft-dev" and logger.swanlab.name == "sft-dev-squad"
    assert logger.gpu_monitoring.collection_interval == 10.0


def test_backends_stay_off_unless_turned_on():
    """NeMo RL turns W&B, TensorBoard and GPU monitoring on by default; here they are off."""
    logger = validate_config(_raw()).logger
    assert not any(
        (
            logger.wandb_enabled,
            logger.mlflow_enabled,
            logger.tensorboard_enabled,
            logger.monitor_gpus,
            logger.swanlab_enabled,
        )
    )


def test_wandb_block_takes_the_init_fields():
    raw = _raw("logger.wandb_enabled=true")
    raw["logger"]["wandb"] = {
        "project": "p",
        "name": "n",
        "entity": "team",
        "group": "sweep-1",
        "tags": ["sft", "small"],
    }
    wandb = validate_config(raw).logger.wandb
    assert (wandb.entity, wandb.group, wandb.tags) == ("team", "sweep-1", ["sft", "small"])


@pytest.mark.parametrize(
    ("key", "package", "extra"),
    [("wandb_enabled", "wandb", "wandb"), ("mlflow_enabled", "mlflow", "mlflow")],
)
def test_a_backend_without_its_package_is_refused(hide, key, package, extra):
    hide(package)
    line = _refusal(_raw(f"logger.{key}=true"))
    assert line == (
        f"logger.{key}: the {package} package is not installed: "
        f"pip install 'sft-runtime[{extra}]' (or set logger.{key}=false)"
    )
    assert getattr(validate_config(_raw(f"logger.{key}=false")).logger, key) is False


def test_mlflow_default_store_needs_sqlalchemy_a_server_does_not(hide):
    """mlflow-skinny alone cannot open the SQLite store in the run; against a tracking
    server it is enough."""
    hide("sqlalchemy", "alembic")
    line = _refusal(_raw("logger.mlflow_enabled=true"))
    assert line.startswith(
        "logger.mlflow_enabled: the sqlalchemy and alembic packages are not installed: "
        "pip install 'sft-runtime[mlflow]'"
    )
    raw = _raw("logger.mlflow_enabled=true", "logger.mlflow.tracking_uri=http://mlflow:5000")
    assert validate_config(raw).logger.mlflow.tracking_uri == "http://mlflow:5000"


def test_swanlab_is_refused_on_and_inert_off():
    line = _refusal(_raw("logger.swanlab_enabled=true"))
    assert line.startswith("logger.swanlab_enabled: SwanLab is not supported here")
    raw = _raw("logger.swanlab_enabled=false")
    raw["logger"]["swanlab"] = {"project": "sft-dev", "name": "x"}
    assert validate_config(raw).logger.swanlab.project == "sft-dev"


@pytest.mark.parametrize("block", ["wandb", "mlflow", "swanlab", "gpu_monitoring"])
def test_an_unknown_key_in_a_backend_block_is_named(block):
    raw = _raw()
    raw["logger"][block] = {"colour": "blue"}
    assert _refusal(raw) == f"logger.{block}.colour: unknown key"


def test_gpu_intervals_must_be_positive():
    raw = _raw()
    raw["logger"]["gpu_monitoring"] = {"collection_interval": 0}
    assert _refusal(raw).startswith("logger.gpu_monitoring.collection_interval:")


def test_train_exits_2_before_ray_without_the_package(hide, tmp_path, monkeypatch, capsys):
    import sft_runtime.runtime.launch.driver as driver

    def must_not_run(*args, **kwargs):
        raise AssertionError("Ray started although the config should have been refused")

    monkeypatch.setattr(driver, "run_training", must_not_run)
    hide("wandb")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_raw(tmp_path / "run", tmp_path / "data")))
    assert main(["train", str(config), "logger.wandb_enabled=true"]) == 2
    err = capsys.readouterr().err
    assert "logger.wandb_enabled: the wandb package is not installed: " in err
    assert "pip install 'sft-runtime[wandb]'" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()

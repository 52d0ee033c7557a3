"""A full disk, found under any wrapper, becomes one `DiskFullError`: one line, exit 1.

tests/reliability/test_full_disk.py fills a real filesystem (root and a loop device); these
check the same path piece by piece anywhere: the walk through wrapped errors, the checkpoint
that names itself, the controller's conversion and the CLI's line.
"""

from __future__ import annotations

import errno
import pickle

import pytest
import yaml

from sft_runtime.events import read_log
from sft_runtime.runtime.checkpoint.save import CheckpointWriteError
from sft_runtime.runtime.errors import DiskFullError, RunFailure
from sft_runtime.runtime.process.disk_full import disk_full_error
from sft_runtime.runtime.workers.group import PolicyWorkerError
from tests.support.small_run import small_raw
from tests.unit.controller.test_controller_errors import StubGroup, _controller


class RayLikeError(RuntimeError):
    """What a failed Ray call raises: the worker's own error rides in ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray task failed: {cause}")
        self.cause = cause


def worker_error(code: int = errno.ENOSPC) -> PolicyWorkerError:
    """The group's error for a worker whose ``os.write`` was refused (no file name)."""
    err = PolicyWorkerError("checkpoint_written failed: rank 1: OSError: ...", [1])
    err.__cause__ = RayLikeError(OSError(code, "No space left on device"))
    return err


def test_a_refused_write_is_found_under_every_wrapper():
    assert disk_full_error(RuntimeError("outer"), where="/run") is None
    err = RuntimeError("the controller's failure")
    err.__context__ = worker_error()
    full = disk_full_error(err, where="/run")
    assert isinstance(full, DiskFullError) and full.errno == errno.ENOSPC
    assert str(full) == (
        "no space left on device writing /run; free space and run the same command again"
    )


def test_quota_counts_other_errors_do_not():
    assert disk_full_error(worker_error(errno.EDQUOT)).errno == errno.EDQUOT
    assert disk_full_error(worker_error(errno.EIO)) is None
    assert disk_full_error(ValueError("no")) is None


def test_what_was_written_comes_from_the_chain_first():
    named = CheckpointWriteError(28, "could not write", written="checkpoint /r/step_6")
    named.__cause__ = worker_error()
    assert disk_full_error(named, where="/r").what == "checkpoint /r/step_6"
    with_name = OSError(errno.ENOSPC, "No space left on device", "/r/events.jsonl")
    assert disk_full_error(with_name, where="/r").what == "/r/events.jsonl"


def test_the_message_says_where_the_same_command_resumes():
    assert str(DiskFullError(errno.ENOSPC, "X", 3)).endswith(
        "; free space and run the same command to resume from step 3"
    )
    assert "start again (no checkpoint was saved)" in str(DiskFullError(errno.ENOSPC, "X", 0))
    kept = disk_full_error(RayLikeError(DiskFullError(errno.ENOSPC, "X")), resume_step=5)
    assert kept.what == "X" and kept.resume_step == 5


def test_it_crosses_ray_as_itself_and_is_still_an_oserror():
    err = pickle.loads(pickle.dumps(DiskFullError(errno.EDQUOT, "checkpoint /r/step_3", 0)))
    assert isinstance(err, DiskFullError) and isinstance(err, OSError)
    assert isinstance(err, RunFailure)
    assert (err.errno, err.what, err.resume_step) == (errno.EDQUOT, "checkpoint /r/step_3", 0)
    assert str(err).startswith("disk quota exceeded writing checkpoint /r/step_3; ")
    written = pickle.loads(pickle.dumps(CheckpointWriteError(28, "m", written="checkpoint c")))
    assert (written.errno, written.written) == (28, "checkpoint c")


def test_a_worker_out_of_space_fails_the_save_naming_the_checkpoint(tmp_path):
    full = worker_error()
    group = StubGroup({"checkpoint_written": full, "save_checkpoint": full})
    controller, run_dir = _controller(tmp_path, group)
    with pytest.raises(CheckpointWriteError) as err:
        controller.run()
    step_dir = run_dir / "checkpoints" / "step_3"
    assert err.value.errno == errno.ENOSPC and err.value.written == f"checkpoint {step_dir}"
    assert "settle" in group.calls  # the workers' writes ended before the folder went
    assert list(run_dir.glob("checkpoints/*")) == []  # no tmp_step_3 left
    stopped = list(read_log(run_dir, validate=True))[-1]
    assert stopped.type == "run_stopped" and stopped.data["reason"] == "failed"
    line = str(controller._as_disk_full(err.value))
    assert line == (
        f"no space left on device writing checkpoint {step_dir}; free space and run the "
        "same command to start again (no checkpoint was saved)"
    )


# ------------------------------------------------------------------------------ the CLI
def test_the_cli_prints_one_line_and_exits_1(tmp_path, capsys, monkeypatch):
    """A refused write in the driver (before the controller exists): the line names the
    file and the step of the newest checkpoint."""
    from sft_runtime.runtime.cli.main import main
    from sft_runtime.runtime.launch import driver

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_3").mkdir(parents=True)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(small_raw(run_dir, tmp_path / "data", 7)))

    def refused(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "events.lock"))
        except OSError as exc:
            raise RuntimeError("setup failed") from exc

    monkeypatch.setattr(driver, "run_training", refused)
    capsys.readouterr()
    assert main(["train", str(config), "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"sft-runtime train: error: no space left on device writing {run_dir / 'events.lock'}; "
        "free space and run the same command to resume from step 3"
    ]

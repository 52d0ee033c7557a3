"""Bad input gets exit code 2 and one line naming the thing; nothing saved is lost.

Each test backs one row of docs/bad_input.md. `sft-runtime train` runs in-process on the
session's Ray (an exception that escapes `main` is what makes the real command exit 1).
"""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sft_runtime.events import read_log
from tests.support.reliability import (
    BIN,
    STEPS,
    compare,
    dir_digest,
    refused,
    rewind_copy,
    train,
    verify,
)
from tests.support.small_run import small_config, small_raw

NEMO_RL_SFT = Path(__file__).resolve().parents[1] / "support" / "nemo_rl" / "sft.yaml"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (
            "policy.dtensor_cfg.tensor_parallel_size=2",
            "policy.dtensor_cfg.tensor_parallel_size=2 is not supported",
        ),
        (
            "policy.megatron_cfg.enabled=true",
            "policy.megatron_cfg.enabled=true: Megatron-Core is not supported",
        ),
        (
            "policy.dtensor_cfg.sequence_parallel=true",
            "policy.dtensor_cfg.sequence_parallel=True is not supported",
        ),
        ("logger.swanlab_enabled=true", "logger.swanlab_enabled"),
        ("+policy.parallel.fsdp=true", "policy.parallel: NeMo RL's name is policy.dtensor_cfg"),
        (
            "+policy.model.hf_path=/models/x",
            "NeMo RL's name for the pretrained model is policy.model_name",
        ),
        ("+data.energon.num_workers=2", "data.num_workers"),
        ("data.train.dataset_name=squad", "a hub data set cannot be fetched here"),
        (
            "policy.dtensor_cfg.enabled=false policy.dtensor_cfg.cpu_offload=true",
            "policy.dtensor_cfg.cpu_offload is set but policy.dtensor_cfg.enabled is false",
        ),
    ],
)
def test_nemo_rl_keys_asking_for_what_is_not_here(override, named, tmp_path):
    """NeMo RL's own file, the overrides a user here gives, and one value this runtime does
    not have (or a former name of ours): exit 2, one line naming the key, before Ray."""
    base = (
        "policy.model_name=/models/tiny",
        "cluster.gpus_per_node=0",
        "data.train.dataset_name=openai_format",
        f"+data.train.data_path={tmp_path / 'train.jsonl'}",
        "data.validation=null",
    )
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            str(BIN),
            "train",
            "--config",
            str(NEMO_RL_SFT),
            *base,
            *override.split(),
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    problems = [line for line in done.stderr.splitlines() if line.startswith("  ")]
    assert len(problems) == 1 and named in problems[0], done.stderr
    assert "Traceback" not in done.stderr and not run_dir.exists()


def _bad_data_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("sft.max_num_steps=0", "sft.max_num_steps: Input should be greater than or equal to 1"),
        ("sft.max_num_step=3", "sft.max_num_step: unknown key (did you mean 'sft.max_num_steps'?)"),
        ("policy.train_micro_batch_size=three", "policy.train_micro_batch_size"),
        ("data.energon.topology_mapper=mimo", "data.energon.topology_mapper"),
    ],
)
def test_invalid_config_values_and_unknown_keys(override, named, demo_data, tmp_path):
    config = tmp_path / "config.yaml"
    run_dir = tmp_path / "run"
    config.write_text(yaml.safe_dump(small_raw(run_dir, demo_data, STEPS)))
    done = subprocess.run(
        [str(BIN), "train", str(config), override, "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert named in done.stderr
    assert "Traceback" not in done.stderr
    assert not run_dir.exists()  # refused before anything was created


# ------------------------------------------------------------------------------ data sets
def test_a_missing_data_set(demo_data, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    rc, out = train(tmp_path / "run", demo_data, capsys, f"data.train.path={missing}")
    assert rc == 2, out
    assert f"data.train.path {str(missing)!r} is not a prepared energon data set" in out


def test_an_empty_data_set_directory(demo_data, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out = train(tmp_path / "run", demo_data, capsys, f"data.train.path={empty}")
    assert rc == 2, out
    assert f"data.train.path {str(empty)!r} is not a prepared energon data set" in out


def test_a_data_set_with_empty_metadata(ray_session, demo_data, tmp_path, capsys):
    empty = tmp_path / "empty_meta"
    (empty / ".nv-meta").mkdir(parents=True)
    rc, out = train(tmp_path / "run", demo_data, capsys, f"data.train.path={empty}")
    assert rc == 2, out
    assert str(empty) in out


def test_a_data_set_too_small_for_the_dp_world_size(ray_session, tmp_path, capsys):
    from sft_runtime.runtime.data.demo import build_demo_dataset

    tiny = build_demo_dataset(tmp_path / "tiny", num_samples=1, seed=0)
    rc, out = train(tmp_path / "run", tiny, capsys)
    assert rc == 2, out
    assert "data.train.path" in out and "data-parallel" in out


def test_a_truncated_tar_shard(ray_session, demo_data, tmp_path, capsys):
    data = _bad_data_copy(demo_data, tmp_path / "data")
    shard = data / "train-000000.tar"
    with open(shard, "r+b") as fh:
        fh.truncate(3000)
    rc, out = train(tmp_path / "run", data, capsys)
    assert rc == 2, out
    assert "train-000000.tar" in out


def test_a_scribbled_tar_shard(ray_session, demo_data, tmp_path, capsys):
    data = _bad_data_copy(demo_data, tmp_path / "data")
    shard = data / "train-000000.tar"
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:  # keep the first header, scribble over every sample
        fh.seek(512)
        fh.write(bytes((i * 37 + 11) % 256 for i in range(size - 512)))
    rc, out = train(tmp_path / "run", data, capsys)
    assert rc == 2, out
    assert "train-000000.tar" in out


# ------------------------------------------------------------------------------ checkpoints
def test_a_checkpoint_without_training_info_is_refused(reference, demo_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    info = run_dir / "checkpoints" / f"step_{STEPS}" / "training_info.json"
    info.unlink()
    out = refused(run_dir, demo_data, capsys)
    assert f"{info}: missing; the checkpoint is incomplete" in out


def test_truncated_checkpoint_weights_are_refused(reference, demo_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    weights = run_dir / "checkpoints" / f"step_{STEPS}" / "policy" / "weights"
    path = weights / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    out = refused(run_dir, demo_data, capsys)
    assert "model.safetensors" in out


# ------------------------------------------------------------------------------ disk full
def test_disk_full_while_saving_keeps_the_previous_checkpoint_and_the_log(
    reference, demo_data, tmp_path, monkeypatch
):
    """The controller runs in this process so the save can be made to hit ENOSPC."""
    import sft_runtime.runtime.checkpoint.save as save_checkpoint
    from sft_runtime.runtime.controller.loop import SFTController
    from sft_runtime.runtime.launch.setup import setup_sft_v2

    real = save_checkpoint.dumps_loader_states
    calls = []

    def dumps_until_full(states):
        calls.append(len(states))
        if len(calls) == 2:  # the checkpoint at step 6
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(states)

    monkeypatch.setattr(save_checkpoint, "dumps_loader_states", dumps_until_full)
    run_dir = tmp_path / "run"
    config = small_config(run_dir, demo_data, STEPS)
    args = setup_sft_v2(config)
    try:
        with pytest.raises(OSError) as err:
            SFTController(config, args).run()
    finally:
        args.trainer.shutdown()
    assert err.value.errno == errno.ENOSPC
    assert f"could not write checkpoint {run_dir / 'checkpoints' / 'step_6'}" in str(err.value)
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_3"]  # no tmp_step_6 left
    step_3 = dir_digest(ckpt / "step_3")
    records = list(read_log(run_dir, validate=True))
    assert [r.data["step"] for r in records if r.type == "checkpoint_saved"] == [3]
    stopped = [r for r in records if r.type == "run_stopped"]
    assert [s.data["reason"] for s in stopped] == ["failed"]
    assert "No space left on device" in stopped[0].data["error"]
    assert verify(run_dir)[0] == 0

    monkeypatch.setattr(save_checkpoint, "dumps_loader_states", real)
    from sft_runtime.runtime.launch.driver import run_training

    summary = run_training(small_config(run_dir, demo_data, STEPS))
    assert summary["resumed_from_step"] == 3
    assert dir_digest(ckpt / "step_3") == step_3
    assert compare(run_dir, reference).mismatches == []


def test_a_rewound_copy_resumes_from_its_checkpoint(reference, tmp_path):
    """The fixture the damaged-state tests build on: a prefix of the log is a valid run."""
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    assert verify(run_dir)[0] == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3"]

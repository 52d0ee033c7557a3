"""Bad arguments get exit code 2 and one line naming the path or key, before anything starts.

Each test backs a row of docs/bad_input.md. The commands run in-process through the CLI's
`main`, as the console script calls it; `run_training` is replaced by a tripwire, so a
refusal that came too late (after Ray or the workers were asked for) fails the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.reliability import STEPS
from tests.support.small_run import small_raw

DATA = Path("/nonexistent/data")  # never read: every case is refused before the data is


@pytest.fixture
def no_training(monkeypatch):
    """Any attempt to start a run fails the test."""
    from sft_runtime.runtime.launch import driver

    def tripwire(*args, **kwargs):
        raise AssertionError("a run was started: the refusal came too late")

    monkeypatch.setattr(driver, "run_training", tripwire)


def run_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """(exit code, stderr's lines) of `sft-runtime ARGV`."""
    from sft_runtime.runtime.cli.main import main

    capsys.readouterr()
    rc = main([*argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err.splitlines()


def one_error_line(rc: int, lines: list[str], command: str) -> str:
    assert rc == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"sft-runtime {command}: error: "), lines
    return lines[0]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def write_config(path: Path, run_dir: Path, data_dir: Path) -> Path:
    path.write_text(yaml.safe_dump(small_raw(run_dir, data_dir, STEPS)))
    return path


# ------------------------------------------------------------------------------ train
def test_a_run_dir_that_is_a_file(no_training, tmp_path, capsys):
    config = write_config(tmp_path / "config.yaml", tmp_path / "unused", DATA)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a run directory\n")
    before = tree(tmp_path)
    rc, lines = run_cli(capsys, "train", str(config), "--run-dir", str(a_file))
    line = one_error_line(rc, lines, "train")
    assert f"--run-dir '{a_file}': a file, not a directory" in line, line
    assert tree(tmp_path) == before  # nothing created
    assert a_file.read_text() == "not a run directory\n"


def test_a_run_dir_inside_a_file(no_training, tmp_path, capsys):
    config = write_config(tmp_path / "config.yaml", tmp_path / "unused", DATA)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    rc, lines = run_cli(capsys, "train", str(config), "--run-dir", str(a_file / "run"))
    line = one_error_line(rc, lines, "train")
    assert f"--run-dir '{a_file / 'run'}': {a_file} is a file, not a directory" in line, line


def test_a_log_dir_in_the_config_that_is_a_file(no_training, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    config = write_config(tmp_path / "config.yaml", a_file, DATA)
    rc, lines = run_cli(capsys, "train", str(config))
    line = one_error_line(rc, lines, "train")
    assert f"logger.log_dir '{a_file}': a file, not a directory" in line, line


def test_a_directory_given_as_the_config_file(no_training, tmp_path, capsys):
    folder = tmp_path / "configs"
    folder.mkdir()
    rc, lines = run_cli(capsys, "train", str(folder), "--run-dir", str(tmp_path / "run"))
    line = one_error_line(rc, lines, "train")
    assert f"{folder}: a directory, not a config file" in line, line
    assert not (tmp_path / "run").exists()


def test_a_binary_config_file(no_training, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_bytes(b"\xff\xfe\x00binary")
    rc, lines = run_cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "run"))
    line = one_error_line(rc, lines, "train")
    assert f"{config}: not a text file" in line, line


def test_a_duplicate_key_names_the_file_the_line_and_the_key(no_training, tmp_path, capsys):
    run_dir = tmp_path / "run"
    text = yaml.safe_dump(small_raw(run_dir, DATA, STEPS), sort_keys=False)
    lines = text.splitlines()
    at = lines.index("sft:") + 1  # the first key of the sft section, repeated
    lines.insert(at, "  max_num_steps: 3")
    lines.insert(at, "  max_num_steps: 2")
    config = tmp_path / "config.yaml"
    config.write_text("\n".join(lines) + "\n")
    rc, err = run_cli(capsys, "train", str(config), "--run-dir", str(run_dir))
    line = one_error_line(rc, err, "train")
    assert (
        f"{config} line {at + 2}: duplicate key 'sft.max_num_steps' (first at line {at + 1})"
        in line
    ), line
    assert not run_dir.exists()


def test_a_duplicate_section_is_refused_too(no_training, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("sft:\n  max_num_steps: 3\nlogger:\n  log_dir: x\nsft:\n  seed: 1\n")
    rc, lines = run_cli(capsys, "train", str(config))
    line = one_error_line(rc, lines, "train")
    assert f"{config} line 5: duplicate key 'sft' (first at line 1)" in line, line


def test_anchors_and_merge_keys_are_not_duplicates():
    from sft_runtime.runtime.config_files.yaml_keys import check_unique_keys

    check_unique_keys(
        "base: &b\n  lr: 1\n  wd: 2\nother:\n  <<: *b\n  lr: 3\nthird: *b\n", "config.yaml"
    )


# ------------------------------------------------------------------------------ RUN_DIR
READERS = {
    "events": lambda run: ["events", run],
    "verify": lambda run: ["verify", run],
    "replay": lambda run: ["replay", run],
    "trace": lambda run: ["trace", run],
    "samples": lambda run: ["samples", run, "--step", "1"],
    "reproduce": lambda run: ["reproduce", run, "--step", "1"],
    "diff": lambda run: ["diff", run, run],
    "export": lambda run: ["export", run, str(Path(run).parent / "out")],
}


@pytest.mark.parametrize("command", sorted(READERS))
def test_a_run_dir_argument_that_is_a_file(command, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    before = tree(tmp_path)
    rc, lines = run_cli(capsys, *READERS[command](str(a_file)))
    line = one_error_line(rc, lines, command)
    assert f"{a_file}: a file, not a run directory" in line, line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", sorted(READERS))
def test_a_run_dir_argument_that_does_not_exist(command, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    rc, lines = run_cli(capsys, *READERS[command](str(missing)))
    line = one_error_line(rc, lines, command)
    assert f"{missing}: no such run directory" in line, line
    assert tree(tmp_path) == []

"""`sft-runtime diff`: config keys that differ, then the first step whose samples or loss do."""

from __future__ import annotations

import json

import yaml

from sft_runtime.events.run_diff import diff_runs
from sft_runtime.runtime.cli.diff import dotted_diff
from sft_runtime.runtime.cli.main import main
from tests.support.logbuild import Attempt, write_run


def _run(root, name, attempts, config):
    run_dir = root / name
    write_run(run_dir, attempts)
    ckpt = run_dir / "checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


def _runs(tmp_path):
    config = {
        "sft": {"seed": 7, "max_num_steps": 6},
        "policy": {"optimizer": {"kwargs": {"lr": 0.001}}},
    }
    a = _run(tmp_path, "a", [Attempt(until=6)], config)
    changed = {**config, "sft": {"seed": 8, "max_num_steps": 6}, "logger": {"jsonl": False}}
    # run B resumes at 3 with other samples from step 4 and another loss at step 5
    b = _run(
        tmp_path,
        "b",
        [
            Attempt(until=3, save_every=3, stop=None),
            Attempt(until=6, resume=3, salt="x", loss_bump=5),
        ],
        changed,
    )
    return a, b


def test_the_first_differing_steps_and_the_config_keys(tmp_path, capsys):
    a, b = _runs(tmp_path)
    result = diff_runs(a, b)
    assert [s.step for s in result.common] == [1, 2, 3, 4, 5, 6]
    assert result.first_sample_difference.step == 4
    assert result.first_loss_difference.step == 5
    assert result.first_loss_difference.loss_delta == 0.123 - 1 / 5
    assert not result.identical
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "sft.seed: 7 -> 8" in out and "logger: '<absent>' -> {'jsonl': False}" in out
    assert "first step whose samples differ: 4" in out
    assert "first step whose loss differs: 5 (by -0.077" in out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["first_sample_difference"]["step"] == 4
    assert [row["samples_agree"] for row in data["steps"]] == [True] * 3 + [False] * 3
    assert ["sft.seed", 7, 8] in data["config"]


def test_a_run_against_itself_is_identical_and_bad_dirs_exit_2(tmp_path, capsys):
    a, _ = _runs(tmp_path)
    assert main(["diff", str(a), str(a)]) == 0
    assert "config: identical" in capsys.readouterr().out
    assert main(["diff", str(a), str(tmp_path / "nowhere")]) == 2


def test_dotted_diff_names_nested_keys():
    assert dotted_diff({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 4}) == [
        ("a.c", 2, 3),
        ("d", "<absent>", 4),
    ]

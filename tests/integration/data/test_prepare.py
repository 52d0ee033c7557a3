"""prepare-data and demo-data: validation by line, --skip-bad, and energon accepting the output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sft_runtime.runtime.cli.prepare import main

GOOD = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"prompt": "1+1", "response": "2"},
    {
        "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]
    },
]
BAD_LINES = {
    "bad_json": ('{"prompt": "x", ', "invalid JSON"),
    "unknown_role": (
        json.dumps(
            {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}
        ),
        "role 'robot'",
    ),
    "no_assistant": (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant"),
    "empty_content": (
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}
        ),
        "content is empty",
    ),
    "empty_response": (json.dumps({"prompt": "x", "response": ""}), "no assistant turn"),
    "not_a_conversation": (json.dumps({"text": "x"}), "expected a 'messages' list"),
}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_line_is_named_and_exits_2(tmp_path, capsys, kind):
    bad, reason = BAD_LINES[kind]
    src = _write(tmp_path / "in.jsonl", [json.dumps(GOOD[0]), "", bad, json.dumps(GOOD[1])])
    code = main(["prepare-data", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{src}:3:" in err and reason in err
    assert not (tmp_path / "out").exists(), "nothing is written when a line is bad"


def test_skip_bad_counts_and_prepares_the_rest(tmp_path, capsys):
    lines = [json.dumps(g) for g in GOOD] + [BAD_LINES["bad_json"][0], BAD_LINES["no_assistant"][0]]
    src = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    assert main(["prepare-data", str(src), str(out), "--skip-bad", "--shard-size", "2"]) == 0
    printed = capsys.readouterr().out
    assert "skipped 2 bad line(s): 4, 5" in printed
    assert "wrote 3 train and 0 val samples in 2 shard(s)" in printed
    info = json.loads((out / ".nv-meta" / ".info.json").read_text())
    assert sum(info["shard_counts"].values()) == 3


def test_val_fraction_gives_a_val_split_and_energon_info_accepts_it(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) for i in range(20)]
    src = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    assert main(["prepare-data", str(src), str(out), "--val-fraction", "0.25"]) == 0
    energon = Path(sys.executable).with_name("energon")
    result = subprocess.run(
        [str(energon), "info", str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "20 samples" in result.stdout
    assert "`train`: 75%, 15 samples" in result.stdout
    assert "`val`: 25%, 5 samples" in result.stdout


def test_prepared_val_split_loads_through_energon(tmp_path, make_loader):
    lines = [json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) for i in range(12)]
    src = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    assert main(["prepare-data", str(src), str(out), "--val-fraction", "0.5", "--seed", "3"]) == 0
    loader = make_loader(data_path=str(out), split="val", batch_size=2, shuffle_buffer_size=None)
    keys = {k for _ in range(3) for k in (loader.load().source_ids, loader.commit())[0]}
    assert len(keys) == 6 and all(k.startswith("line") for k in keys)


def test_refuses_non_empty_output_and_missing_input(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [json.dumps(GOOD[0])])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep me")
    assert main(["prepare-data", str(src), str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["prepare-data", str(tmp_path / "nope.jsonl"), str(tmp_path / "o2")]) == 2
    assert "not found" in capsys.readouterr().err


def test_demo_data_is_deterministic(tmp_path, capsys):
    assert main(["demo-data", str(tmp_path / "a"), "--num-samples", "40"]) == 0
    assert main(["demo-data", str(tmp_path / "b"), "--num-samples", "40"]) == 0
    for name in ("train-000000.tar", "train-000003.tar"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert "wrote 40 demo conversations" in capsys.readouterr().out


def test_register_adds_subcommands_with_callables():
    import argparse

    from sft_runtime.runtime.cli.prepare import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["prepare-data", "in.jsonl", "out", "--seed", "4", "--skip-bad"])
    assert callable(args.func) and args.seed == 4 and args.skip_bad
    assert callable(parser.parse_args(["demo-data", "x"]).func)


def test_progress_bar_path_for_large_inputs(tmp_path, monkeypatch):
    import sft_runtime.runtime.data.prepare as prepare

    monkeypatch.setattr(prepare, "PROGRESS_MIN_BYTES", 0)
    src = _write(tmp_path / "in.jsonl", [json.dumps(g) for g in GOOD])
    result = prepare.prepare_jsonl(src, tmp_path / "out")
    assert (result.num_train, result.num_val, result.skipped_lines) == (3, 0, [])

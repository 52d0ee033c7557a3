"""`sft-runtime events RUN_DIR --plot FILE.png`: what the figure marks, the PNG it writes,
and bad input (exit 2, one line, no file written)."""

from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys

import pytest

from sft_runtime.events import read_log
from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.cli.plot import collect, draw
from tests.support.logbuild import Attempt, write_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_dir(tmp_path):
    """Attempt 1 aborts step 5 and crashes after step 6; attempt 2 resumes from 3, re-runs 4-6
    and aborts 7; attempt 3 resumes from 8."""
    write_run(
        tmp_path,
        [
            Attempt(until=6, save_every=3, stop=None, abort_at=5),
            Attempt(until=8, resume=3, save_every=4, abort_at=7),
            Attempt(until=10, resume=8),
        ],
    )
    return tmp_path


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's header, after checking its signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_collect_separates_attempts_reexecutions_rollbacks_aborts_and_checkpoints(run_dir):
    first, second, third = collect(read_log(run_dir))
    assert (first.number, first.resumed_from_step, first.steps) == (1, None, [1, 2, 3, 4, 5, 6])
    assert first.rolled_back == [4, 5, 6] and first.reexecuted == []
    assert first.aborts == [5] and first.checkpoints == [3, 6]
    assert (second.resumed_from_step, second.steps) == (3, [4, 5, 6, 7, 8])
    assert second.reexecuted == [4, 5, 6] and second.rolled_back == []
    assert second.aborts == [7] and second.checkpoints == [4, 8]
    assert (third.resumed_from_step, third.steps, third.reexecuted) == (8, [9, 10], [])
    # lr and tokens/s from the record: valid tokens over total_step_time (0.01 s in logbuild)
    assert second.lr == [1e-3] * 5
    assert second.tokens_per_s == pytest.approx([(100 + s) / 0.01 for s in range(4, 9)])
    assert second.loss == pytest.approx([1 / s for s in range(4, 9)])


def test_the_figure_marks_attempts_resumes_reexecutions_aborts_and_checkpoints(run_dir):
    fig = draw(collect(read_log(run_dir)), "run")
    loss, lr, speed = fig.axes
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "learning rate", "tokens/s"]
    legend = {t.get_text() for t in loss.get_legend().get_texts()}
    assert legend == {
        "attempt 1",
        "attempt 2",
        "attempt 3",
        "re-executed after a resume",
        "rolled back by a resume",
        "aborted step",
        "checkpoint",
    }
    labels = {t.get_text() for t in loss.texts}
    assert labels == {"attempt 1", "attempt 2 (resumed from 3)", "attempt 3 (resumed from 8)"}
    for ax in fig.axes:  # every panel: the re-run steps, the aborts and the checkpoints
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines["re-executed after a resume"].get_xdata()) == [4, 5, 6]
        aborts = [line for line in ax.get_lines() if line.get_label() == "aborted step"]
        assert sorted(x for line in aborts for x in line.get_xdata()) == [5, 7]
        dotted = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
        assert sorted(line.get_xdata()[0] for line in dotted) == [3, 4, 6, 8]
    assert list(speed.get_lines()[0].get_ydata()) == pytest.approx(
        [(100 + s) / 0.01 for s in range(1, 7)]
    )
    assert list(lr.get_lines()[0].get_ydata()) == [1e-3] * 6


def test_plot_writes_a_png_atomically_and_prints_its_path(run_dir, tmp_path, capsys):
    from matplotlib.image import imread

    out = tmp_path / "out" / "run.png"
    out.parent.mkdir()
    assert main(["events", str(run_dir), "--plot", str(out)]) == 0
    assert f"plot: {out}" in capsys.readouterr().out
    assert png_size(out) == (1100, 850)
    assert imread(out).shape[:2] == (850, 1100)
    assert [p.name for p in out.parent.iterdir()] == ["run.png"]  # no temporary file left
    assert main(["events", str(run_dir), "--plot", str(out)]) == 0  # replaces the old one
    assert png_size(out) == (1100, 850)


def test_plot_without_matplotlib_exits_2_naming_the_install(run_dir, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    out = run_dir / "plot.png"
    assert main(["events", str(run_dir), "--plot", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the log is read
    assert captured.err.strip().splitlines() == [
        "sft-runtime events: error: --plot needs matplotlib, which is not installed: "
        "pip install 'sft-runtime[plot]'"
    ]
    assert not out.exists()


def test_plot_of_bad_input_exits_2_with_one_line_and_writes_nothing(run_dir, tmp_path, capsys):
    out = tmp_path / "plot.png"
    cases = [
        (tmp_path / "nope", out, "no such run directory"),
        (run_dir, tmp_path / "plot.svg", "name it FILE.png"),
        (run_dir, tmp_path / "missing" / "plot.png", "no such directory"),
    ]
    for run, target, expected in cases:
        assert main(["events", str(run), "--plot", str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0]
        assert not target.exists()
    path = run_dir / "events.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[6] = lines[6].replace(b'"loss":', b'"loss":1')
    path.write_bytes(b"".join(lines))
    assert main(["events", str(run_dir), "--plot", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path} line 7: digest mismatch" in err[0]
    assert not out.exists()


def test_matplotlib_loads_only_for_plot_and_torch_and_ray_never(run_dir):
    code = (
        "import sys; from sft_runtime.runtime.cli import main\n"
        "assert main(['events', sys.argv[1]]) == 0\n"
        "print('WITHOUT', 'matplotlib' in sys.modules)\n"
        "assert main(['events', sys.argv[1], '--plot', sys.argv[1] + '/p.png']) == 0\n"
        "print('WITH', 'matplotlib' in sys.modules)\n"
        "print('HEAVY', [m for m in ('torch', 'ray', 'megatron') if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, check=True
    ).stdout
    assert "WITHOUT False" in out and "WITH True" in out and "HEAVY []" in out


def test_an_attempt_on_another_number_of_workers_is_labelled_with_it(run_dir):
    records = list(read_log(run_dir))
    started = next(r for r in records if r.type == "run_started" and r.attempt == 2)
    change = started._replace(
        type="placement_changed",
        data={
            "resumed_from_step": 3,
            "old_world_size": 2,
            "new_world_size": 1,
            "shards": 2,
            "shard_map": [[0, 1]],
        },
    )
    records.insert(records.index(started) + 1, change)
    series = collect(records)
    assert [s.workers for s in series] == [None, 1, None]
    loss = draw(series, "run").axes[0]
    assert " W=1" in {t.get_text() for t in loss.texts}

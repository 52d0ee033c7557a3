"""Where `samples` and `reproduce` start, and what `reproduce` reports, on written logs.

The real runs are in tests/integration/debug/test_debug_commands.py; here the lineage cases a
single run does not have (a resume that rolled steps back) and the report's wording.
"""

from __future__ import annotations

import pytest

from sft_runtime.events import read_log, records_in_effect
from sft_runtime.events.run_diff import diff_runs
from sft_runtime.runtime.cli.reproduce import _print
from sft_runtime.runtime.debug.reproduce import check_scratch, prepare_scratch
from sft_runtime.runtime.debug.start import find_start
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.states import replay
from tests.support.logbuild import Attempt, sample_digest, write_run


def _run(tmp_path, attempts, on_disk):
    run_dir = tmp_path / "run"
    write_run(run_dir, attempts)
    for step in on_disk:
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
    return run_dir


def test_the_checkpoint_in_effect_is_the_start_and_its_log_prefix_resumes_there(tmp_path):
    # attempt 1 saves 3 and 6 and dies at 7; attempt 2 resumes from 3 with other samples
    run_dir = _run(
        tmp_path,
        [
            Attempt(until=7, save_every=3, stop=None),
            Attempt(until=8, resume=3, save_every=3, salt="x"),
        ],
        on_disk=[3, 6],
    )
    start = find_start(run_dir, 8)
    assert (start.checkpoint, list(start.steps)) == (6, [7, 8])
    assert start.facts[5].digests[0] == sample_digest(5, 0, "x")  # the re-executed step
    scratch = tmp_path / "scratch"
    prepare_scratch(start, scratch)
    records = list(records_in_effect(read_log(scratch)))
    last = records[-1]
    assert (last.type, last.data["step"], last.attempt) == ("checkpoint_saved", 6, 2)
    assert replay(scratch).total_steps == 6
    assert (scratch / "checkpoints" / "step_6").is_dir()
    # before 6 the start is 3, from attempt 1 (attempt 1's own step 6 was rolled back)
    start = find_start(run_dir, 6, until=8)
    assert (start.checkpoint, list(start.steps)) == (3, [4, 5, 6, 7, 8])
    prepare_scratch(start, tmp_path / "scratch3")
    last = list(read_log(tmp_path / "scratch3"))[-1]
    assert (last.type, last.data["step"], last.attempt) == ("checkpoint_saved", 3, 1)


def test_a_checkpoint_the_log_does_not_vouch_for_is_not_a_start(tmp_path):
    run_dir = _run(tmp_path, [Attempt(until=6, save_every=3)], on_disk=[6])  # step_3 pruned
    with pytest.raises(UserInputError, match=r"no checkpoint before step 6: .* holds \[6\]"):
        find_start(run_dir, 6)
    with pytest.raises(UserInputError, match=r"step 7 is beyond the log: .* commits steps 1..6"):
        find_start(run_dir, 7)
    with pytest.raises(UserInputError, match="--to 4 must not be before --step 5"):
        find_start(run_dir, 5, until=4)
    with pytest.raises(UserInputError, match="no such run directory"):
        find_start(tmp_path / "nowhere", 1)


def test_a_scratch_directory_inside_the_run_or_not_empty_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "x").mkdir(parents=True)
    for bad in (run_dir, run_dir / "scratch", tmp_path, run_dir / "x"):
        with pytest.raises(UserInputError):
            check_scratch(run_dir, bad)
    check_scratch(run_dir, tmp_path / "elsewhere")


def test_the_report_names_the_first_divergent_step_and_what_differs(tmp_path, capsys):
    a = _run(tmp_path, [Attempt(until=6)], on_disk=[])
    b = tmp_path / "b"
    write_run(b, [Attempt(until=3, save_every=3, stop=None), Attempt(until=5, resume=3, salt="y")])
    _print(diff_runs(a, b, steps=range(2, 7)))
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in out[1:6]}
    assert rows["3"].split()[1] == "same" and rows["3"].endswith("  -")
    assert rows["4"].split()[1] == "DIFFER" and rows["4"].endswith("  samples")
    assert rows["6"].split()[1:3] == ["-", repr(1 / 6)]  # not re-executed
    assert out[-1] == "first divergent step: 4: samples differ on logical ranks [0, 1]"
    _print(diff_runs(a, a, steps=range(2, 4)))
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "identical: steps 2..3 reproduce bit for bit (samples, loss, grad norm, lr)"

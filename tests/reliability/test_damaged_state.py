"""Damaged run state is repaired where that is safe and refused where it is not.

Every case starts from a copy of the reference run (complete, or rewound to what a crash
right after checkpoint 3 leaves) and runs `sft-runtime train` in-process on the session's
Ray. Repairs must end bit for bit like the reference; refusals must exit 2 with a message
that names the file (and line or values), and leave every saved file as it was.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

from sft_runtime.events import read_log
from tests.support.reliability import (
    STEPS,
    compare,
    refused,
    rewind_copy,
    train,
    verify,
)


def test_a_torn_last_line_is_cut_recorded_and_the_run_resumes(
    reference, demo_data, tmp_path, capsys
):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    lines = (reference.run_dir / "events.jsonl").read_bytes().splitlines(keepends=True)
    kept = (run_dir / "events.jsonl").read_bytes().count(b"\n")
    torn = lines[kept][: len(lines[kept]) // 2]  # the next record, half written
    with open(run_dir / "events.jsonl", "ab") as fh:
        fh.write(torn)
    rc, out = train(run_dir, demo_data, capsys)
    assert rc == 0, out
    assert "resumed from step 3" in out
    repaired = [r for r in read_log(run_dir) if r.type == "log_repaired"]
    assert [(r.attempt, r.data["dropped_bytes"], r.data["at_line"]) for r in repaired] == [
        (2, len(torn), kept + 1)
    ]
    cmp = compare(run_dir, reference)
    assert cmp.mismatches == []


def test_a_flipped_byte_mid_log_is_refused_naming_the_line(reference, demo_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    path = run_dir / "events.jsonl"
    data = bytearray(path.read_bytes())
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")][:-1]
    line = len(starts) // 2  # 0-based index of a line in the middle
    at = data.index(b'"time":', starts[line]) + 9  # a digit of the timestamp
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    path.write_bytes(bytes(data))
    out = refused(run_dir, demo_data, capsys)
    assert f"events.jsonl line {line + 1}: digest mismatch" in out
    rc, vout = verify(run_dir)
    assert rc == 2 and f"line {line + 1}" in vout


def test_a_stale_tmp_step_is_ignored_and_removed(reference, demo_data, tmp_path, capsys):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    for step in (4, 6):  # a crash mid-save leaves a partial temp directory
        tmp = run_dir / "checkpoints" / f"tmp_step_{step}"
        shutil.copytree(reference.run_dir / "checkpoints" / "step_6" / "policy", tmp / "policy")
        (tmp / "sft_v2_loaders.pt").write_bytes(b"half a pickle")
    rc, out = train(run_dir, demo_data, capsys)
    assert rc == 0, out
    assert "resumed from step 3" in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_3",
        "step_6",
        "step_7",
    ]
    assert compare(run_dir, reference).mismatches == []


def test_a_checkpoint_without_loader_states_is_refused(reference, demo_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    missing = run_dir / "checkpoints" / f"step_{STEPS}" / "sft_v2_loaders.pt"
    missing.unlink()
    out = refused(run_dir, demo_data, capsys)
    assert f"{missing}: missing" in out


def test_a_log_that_disagrees_with_training_info_is_refused_showing_both(
    reference, demo_data, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    info_path = run_dir / "checkpoints" / f"step_{STEPS}" / "training_info.json"
    info = json.loads(info_path.read_text())
    logged = info["save_state"]["consumed_samples"]
    info["save_state"]["consumed_samples"] = logged + 8
    info_path.write_text(json.dumps(info))
    out = refused(run_dir, demo_data, capsys)
    assert "disagrees with" in out
    assert f"consumed_samples={logged + 8} vs {logged}" in out


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_loader_state_pickle_is_refused_without_running_it(
    reference, demo_data, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    marker = tmp_path / "pwned"
    crafted = {"format": "sft_v2_loader_states", "version": 1, "states": [_Payload(marker)]}
    loaders = run_dir / "checkpoints" / f"step_{STEPS}" / "sft_v2_loaders.pt"
    loaders.write_bytes(pickle.dumps(crafted))
    out = refused(run_dir, demo_data, capsys)
    assert "refusing to unpickle global posix.system" in out
    assert not marker.exists()

"""`samples` and `reproduce` on a real run: a 7-step two-worker run, checkpoints at 3, 6, 7.

`samples` must give what the loader gave (the log's digests, the data set's conversations,
and a loader read from the very start); `reproduce` must pass on the unchanged run without
touching it, and fail on the right step when the learning rate changes after the
checkpoint or one sample of the data set changes. Bad input exits 2 with one line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

import orjson
import pytest
import yaml

from sft_runtime.events import read_log
from sft_runtime.events.run_diff import step_facts
from sft_runtime.events.schemas import GENESIS, encode
from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.config import load_config, loader_spec
from sft_runtime.runtime.data.loader import ColocatedLoader
from sft_runtime.runtime.data.task_encoder import encode_conversation
from sft_runtime.runtime.data.tokenizer import ByteTokenizer
from sft_runtime.runtime.debug.samples import batch_samples
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.metrics.step_metrics import sample_digest
from tests.support.fixtures import data_set_messages
from tests.support.small_run import small_config

STEPS = 7  # checkpoints at 3 and 6 (save_period) and 7 (the end)
SEQ = 64  # the small run's data.max_input_seq_length


@pytest.fixture(scope="module")
def data_set(tmp_path_factory) -> Path:
    """This module's own data set: one test alters a sample in it (and puts it back)."""
    from sft_runtime.runtime.data.demo import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("debug_data") / "demo", num_samples=256)


@pytest.fixture(scope="module")
def run(ray_session, data_set, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("debug_run") / "run"
    summary = run_training(small_config(run_dir, data_set, STEPS))
    assert summary["reason"] == "completed" and summary["total_steps"] == STEPS
    return run_dir


def _samples_json(run_dir: Path, step: int, capsys) -> list[dict]:
    assert main(["samples", str(run_dir), "--step", str(step), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _rechain(log: Path, change) -> None:
    """Rewrite a log with ``change(record) -> data`` applied, the hash chain made whole
    again: a log that reads as intact but says something else happened."""
    prev, lines = GENESIS, []
    for rec in list(read_log(log)):
        line, prev = encode(rec.seq, rec.type, rec.time, rec.attempt, change(rec), prev)
        lines.append(line + b"\n")
    log.write_bytes(b"".join(lines))


def test_samples_are_what_the_loader_gave(run, data_set, capsys):
    rows = _samples_json(run, 5, capsys)
    logged = step_facts(run)[5].digests
    messages, tokenizer = data_set_messages(data_set), ByteTokenizer()
    assert [row["rank"] for row in rows] == [0, 1]
    for row in rows:
        ids = [s["source_id"] for s in row["samples"]]
        assert row["checkpoint"] == 3 and len(ids) == 4
        assert sample_digest(ids) == row["digest"] == logged[row["rank"]]
        for sample in row["samples"]:  # each sample is the data set's conversation, encoded
            expect, mask = encode_conversation(
                tokenizer, messages[sample["source_id"]], max_length=SEQ
            )
            assert sample["token_ids"] == expect and sample["tokens"] == len(expect)
            assert sample["supervised"] == [int(m) for m in mask]
            assert sample["supervised_tokens"] == sum(mask) > 0
            plain = sample["text"].replace("[[", "").replace("]]", "")
            assert plain == tokenizer.decode(expect)
    # a loader read from the very start (no checkpoint involved) gives the same step-5 batch
    config = load_config(run / "checkpoints" / "step_3" / "config.yaml")
    placement = json.loads((run / "checkpoints" / "step_3" / "training_info.json").read_text())
    for row in rows:
        loader = ColocatedLoader(
            loader_spec(config, 2), row["rank"], 2, placement["save_state"]["placement_hash"]
        )
        loader.setup(None)
        try:
            for _ in range(5):
                loader.load()
                batch = loader.active_batch
                loader.commit()
        finally:
            loader.close()
        fresh = [(s.source_id, list(s.token_ids)) for s in batch_samples(batch, tokenizer)]
        assert fresh == [(s["source_id"], s["token_ids"]) for s in row["samples"]]
    # the text view: one rank, supervised tokens bracketed
    assert main(["samples", str(run), "--step", "5", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "logical rank 1:" in out and "logical rank 0:" not in out
    for sample in rows[1]["samples"]:
        assert sample["source_id"] in out and sample["text"] in out
    assert "<assistant>[[" in out


def test_samples_before_the_first_checkpoint_start_from_the_run_start(run, capsys):
    """Steps 1-3 precede every checkpoint: the loaders are built fresh, as the run built
    them, and each batch still has to match the log's digests."""
    for step in (1, 2, 3):
        rows = _samples_json(run, step, capsys)
        logged = step_facts(run)[step].digests
        assert [row["checkpoint"] for row in rows] == [0, 0]
        assert [row["digest"] for row in rows] == list(logged)
        for row in rows:
            assert sample_digest([s["source_id"] for s in row["samples"]]) == row["digest"]
    assert main(["samples", str(run), "--step", "2", "--rank", "0"]) == 0
    assert "loaders started from the run's start (config from" in capsys.readouterr().out
    # step 4 comes from checkpoint 3, and agrees with the read from the start through it
    assert [row["checkpoint"] for row in _samples_json(run, 4, capsys)] == [3, 3]


def test_samples_from_the_start_refuse_a_log_that_recorded_other_samples(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)

    def other_samples_at_2(rec):
        if rec.type == "step_committed" and rec.data["step"] == 2:
            return {**rec.data, "sample_digests": ["0" * 32, rec.data["sample_digests"][1]]}
        return rec.data

    _rechain(copy / "events.jsonl", other_samples_at_2)
    assert main(["samples", str(copy), "--step", "3"]) == 1
    err = capsys.readouterr().err
    assert "step 2, logical rank 0: the loader started from the run's start" in err


def test_samples_refuse_a_log_that_recorded_other_samples(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)

    def other_samples_at_4(rec):
        if rec.type == "step_committed" and rec.data["step"] == 4:
            return {**rec.data, "sample_digests": [rec.data["sample_digests"][0], "0" * 32]}
        return rec.data

    _rechain(copy / "events.jsonl", other_samples_at_4)
    assert main(["samples", str(copy), "--step", "5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "step 4, logical rank 1:" in captured.err and "0" * 32 in captured.err


def test_reproduce_an_unchanged_run_is_identical_and_leaves_the_run_untouched(
    run, tmp_path, capsys
):
    before = _tree_digest(run)
    scratch = tmp_path / "scratch"
    assert main(["reproduce", str(run), "--step", "5", "--to", "7", "--scratch", str(scratch)]) == 0
    out = capsys.readouterr().out
    assert "identical: steps 4..7 reproduce bit for bit" in out
    assert _tree_digest(run) == before
    # it really trained again: a resume from 3 whose steps 4..7 are new records
    records = list(read_log(scratch))
    resumed = [r.data["resumed_from_step"] for r in records if r.type == "run_started"]
    assert resumed == [None, 3]
    again = [r.data["step"] for r in records if r.type == "step_committed" and r.attempt == 2]
    assert again == [4, 5, 6, 7]


def test_reproduce_finds_the_learning_rate_changed_after_the_checkpoint(run, tmp_path, capsys):
    scratch = tmp_path / "scratch"
    args = ["reproduce", str(run), "--step", "5", "policy.optimizer.kwargs.lr=0.001"]
    assert main([*args, "--scratch", str(scratch)]) == 1
    out = capsys.readouterr().out
    assert "first divergent step: 4: lr 0.003 -> 0.001" in out
    original, now = step_facts(run), step_facts(scratch)
    # step 4's update used the new rate; its loss and gradient were computed before it
    assert (now[4].loss, now[4].grad_norm) == (original[4].loss, original[4].grad_norm)
    assert now[5].loss != original[5].loss and now[5].digests == original[5].digests


def test_reproduce_finds_the_step_that_trained_on_a_changed_sample(run, data_set, capsys):
    step4 = {s["source_id"] for row in _samples_json(run, 4, capsys) for s in row["samples"]}
    step5 = _samples_json(run, 5, capsys)
    key = next(s["source_id"] for s in step5[0]["samples"] if s["tokens"] < SEQ)
    assert key not in step4
    reply = next(m["content"] for m in data_set_messages(data_set)[key] if m["role"] == "assistant")
    shard, offset = _json_member(data_set, key)
    original = shard.read_bytes()
    at = offset + original[offset:].index(orjson.dumps(reply)) + 1  # the reply's first byte
    first = original[at : at + 1]
    flipped = b"1" if first != b"1" else b"2"  # same length: the shard's index stays valid
    shard.write_bytes(original[:at] + flipped + original[at + 1 :])
    try:
        assert main(["reproduce", str(run), "--step", "5"]) == 1
    finally:
        shard.write_bytes(original)
    out = capsys.readouterr().out
    lines = {
        line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["4"], ["5"])
    }
    assert lines["4"].split()[1] == "same" and lines["4"].endswith("  -")
    assert lines["5"].split()[1] == "same" and lines["5"].endswith("  loss, grad_norm")
    assert "first divergent step: 5: loss" in out


def _json_member(data_set: Path, key: str) -> tuple[Path, int]:
    for shard in sorted(data_set.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name == f"{key}.json":
                    return shard, member.offset_data
    raise AssertionError(f"{key} is not in {data_set}")


def _damaged(run: Path, root: Path) -> Path:
    copy = root / "damaged"
    shutil.copytree(run, copy)
    log = copy / "events.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4].replace(b'"step":3', b'"step":9', 1)
    log.write_bytes(b"".join(lines))
    return copy


@pytest.mark.parametrize(
    ("command", "extra", "message"),
    [
        ("reproduce", ["--step", "3"], "no checkpoint before step 3"),
        ("samples", ["--step", "8"], "step 8 is beyond the log"),
        ("reproduce", ["--step", "5", "--to", "9"], "step 9 is beyond the log"),
        ("samples", ["--step", "5", "DAMAGED"], "events.jsonl line 5: digest mismatch"),
        ("reproduce", ["--step", "5", "DAMAGED"], "events.jsonl line 5: digest mismatch"),
        ("reproduce", ["--step", "5", "--scratch", "RUN/scratch"], "must lie outside the run"),
    ],
)
def test_bad_input_exits_2_with_one_line(run, tmp_path, capsys, command, extra, message):
    run_dir = run
    if "DAMAGED" in extra:
        extra = [e for e in extra if e != "DAMAGED"]
        run_dir = _damaged(run, tmp_path)
    extra = [e.replace("RUN", str(run_dir)) for e in extra]
    assert main([command, str(run_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (run / "scratch").exists()


def test_reproduce_refuses_a_config_this_code_does_not_accept(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / "checkpoints" / "step_3" / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["sft"]["retired_knob"] = 1  # a key an older version had
    path.write_text(yaml.safe_dump(raw))
    before = _tree_digest(copy)
    assert main(["reproduce", str(copy), "--step", "5"]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and "sft.retired_knob: unknown key" in err
    assert _tree_digest(copy) == before

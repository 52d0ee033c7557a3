"""A diverged step's numbers (NaN, +-inf) survive the log: every payload schema writes them so
that it reads them back, and every reader of a log (replay, lineage, diff, the timeline, the
plot's series) takes a log holding them. A log written before non-finite values were spelled
out holds ``null`` there, and stays readable too."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sft_runtime.events import compare_reexecutions, history, open_log, read_log
from sft_runtime.events.run_diff import diff_runs
from sft_runtime.events.schemas import (
    GENESIS,
    CheckpointSaved,
    LoadersReady,
    RunStarted,
    RunStopped,
    StepAborted,
    StepCommitted,
    ValidationCompleted,
    encode,
    parse_payload,
)
from sft_runtime.runtime.cli.main import main as cli_main
from sft_runtime.states import replay

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
NUMBERS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.floats(allow_nan=True, allow_infinity=True),
)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@st.composite
def histories(draw) -> list:
    """A run's payloads in an order a run writes them, every measured number drawn from
    NUMBERS (at least one step's loss is not finite)."""
    steps = draw(st.integers(1, 5))
    out: list = [
        RunStarted(placement_hash="p", max_steps=steps),
        LoadersReady(owner_ranks=[0], logical_world_size=1, restored=False, seconds=draw(NUMBERS)),
    ]
    bad = draw(st.integers(1, steps))
    for step in range(1, steps + 1):
        out.append(
            StepCommitted(
                step=step,
                source_samples=4,
                valid_tokens=10,
                physical_packs=4,
                loss=draw(NON_FINITE) if step == bad else draw(NUMBERS),
                grad_norm=draw(NUMBERS),
                lr=draw(NUMBERS),
                timings={"total_step_time": draw(NUMBERS), "load_time": draw(NUMBERS)},
                sample_digests=[f"d{step}"],
            )
        )
        out.append(
            ValidationCompleted(
                step=step,
                loss=draw(NUMBERS),
                tokens=3,
                samples=1,
                sample_digest=f"v{step}",
                seconds=draw(NUMBERS),
            )
        )
    out.append(
        CheckpointSaved(
            step=steps,
            path=f"checkpoints/step_{steps}",
            total_steps=steps,
            consumed_samples=4 * steps,
            total_valid_tokens=10 * steps,
            metric=draw(st.one_of(st.none(), NUMBERS)),
            seconds=draw(NUMBERS),
        )
    )
    out.append(StepAborted(step=steps + 1, phase="metrics", error_type="DivergedError", error="x"))
    out.append(RunStopped(reason="diverged", last_step=steps, error="DivergedError: x"))
    return out


_WRITTEN: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _remove_written():
    yield
    while _WRITTEN:
        shutil.rmtree(_WRITTEN.pop(), ignore_errors=True)


def _write(payloads: list) -> Path:
    run_dir = Path(tempfile.mkdtemp(prefix="sftnan-"))
    _WRITTEN.append(run_dir)
    with open_log(run_dir, fsync=False) as log:
        for payload in payloads:
            log.append(payload)
    return run_dir


@SETTINGS
@given(payloads=histories())
def test_every_payload_reads_back_what_it_wrote_with_non_finite_numbers(payloads):
    run_dir = _write(payloads)
    back = list(read_log(run_dir, validate=True))
    assert [r.type for r in back] == [p.event_type for p in payloads]
    for payload, rec in zip(payloads, back, strict=True):
        parsed = parse_payload(rec.type, rec.data)
        for name, value in payload.model_dump().items():
            got = getattr(parsed, name)
            if isinstance(value, float):
                assert _same(value, got), (rec.type, name, value, got)
            elif isinstance(value, dict):
                assert all(_same(v, got[k]) for k, v in value.items()), (rec.type, name)
            else:
                assert got == value, (rec.type, name)
    # what a resume and every tool read: the fold, lineage, a diff with itself
    assert replay(run_dir).total_steps == sum(
        1 for p in payloads if p.event_type == "step_committed"
    )
    assert history(read_log(run_dir)).attempts[-1].stop_reason == "diverged"
    assert compare_reexecutions(read_log(run_dir))[1] == []
    assert diff_runs(read_log(run_dir), read_log(run_dir)).identical


@SETTINGS
@given(payloads=histories())
def test_the_commands_read_a_log_with_non_finite_numbers(payloads, capsys):
    run_dir = _write(payloads)
    for args in (["events", str(run_dir), "--timeline"], ["replay", str(run_dir), "--json"]):
        assert cli_main(args) == 0, capsys.readouterr()
    assert cli_main(["diff", str(run_dir), str(run_dir)]) == 0, capsys.readouterr()
    capsys.readouterr()


def test_a_log_that_wrote_null_for_a_diverged_loss_stays_readable(tmp_path, capsys):
    """What a log held before: orjson wrote NaN as ``null``, which the schema then refused
    ("step_committed payload: 2 validation errors") in every tool."""
    payloads = [
        RunStarted(placement_hash="p", max_steps=2).model_dump(mode="json"),
        {
            **StepCommitted(
                step=1,
                source_samples=1,
                valid_tokens=1,
                physical_packs=1,
                loss=1.0,
                grad_norm=1.0,
                lr=1.0,
            ).model_dump(mode="json"),
            "loss": None,
            "grad_norm": None,
        },
    ]
    types = ["run_started", "step_committed"]
    prev, lines = GENESIS, []
    for seq, (type_, data) in enumerate(zip(types, payloads, strict=True)):
        line, prev = encode(seq, type_, 1.0, 1, data, prev)
        lines.append(line)
    (tmp_path / "events.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert orjson.loads(lines[1])["data"]["loss"] is None
    rec = list(read_log(tmp_path, validate=True))[1]
    assert math.isnan(parse_payload(rec.type, rec.data).loss)
    for args in (["events", str(tmp_path), "--timeline"], ["verify", str(tmp_path)]):
        assert cli_main(args) == 0, capsys.readouterr()
    assert cli_main(["diff", str(tmp_path), str(tmp_path)]) == 0
    with open_log(tmp_path, fsync=False) as log:  # a resume opens it for writing
        assert log.attempt == 2

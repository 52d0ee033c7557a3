"""A run resumed on another number of workers trains on the same samples, step by step and
shard by shard, and its log proves it.

The session's reference run (2 workers, 2 data shards, 7 steps, checkpoints at 3 and 6) is
the control. The elastic run is a copy of it rewound to checkpoint 3 (what a preemption right
after that save leaves), resumed on ONE worker that loads both shards: its worker dies inside
step 5 (a fault point the run reaches, not a clock); the same command resumes from 3 again,
trains 4-6 and saves; then two workers resume from 6 and train 7. Runs are in-process
`sft-runtime train` calls on the session's Ray.
"""

from __future__ import annotations

import math

import pytest

from sft_runtime.events import read_log, records_in_effect
from tests.support.reliability import committed, rewind_copy, train, verify

ONE_WORKER = "cluster.workers_per_node=1"
# per-step losses across a change of W: the same samples, summed in another order, and the
# difference carried through AdamW; measured about 1e-7 relative on this run
LOSS_RTOL = 1e-4


def _placement_changes(run_dir) -> list[dict]:
    return [r.data for r in read_log(run_dir) if r.type == "placement_changed"]


def test_a_resume_on_one_worker_and_back_on_two_trains_the_reference_samples(
    reference, demo_data, tmp_path, capsys, monkeypatch
):
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    # one worker, killed inside step 5's forward/backward: the step fails, nothing is lost
    monkeypatch.setenv("SFT_RUNTIME_FAULT", "worker:train@5")
    rc, out = train(run_dir, demo_data, capsys, ONE_WORKER)
    assert rc == 1, out
    monkeypatch.delenv("SFT_RUNTIME_FAULT")
    aborted = [r.data["step"] for r in read_log(run_dir) if r.type == "step_aborted"]
    assert aborted == [5], aborted
    rc, out = train(run_dir, demo_data, capsys, ONE_WORKER, "sft.max_num_steps=6")
    assert rc == 0, out
    assert "resumed from step 3" in out
    assert (run_dir / "checkpoints" / "step_6").is_dir()
    rc, out = train(run_dir, demo_data, capsys)  # two workers again
    assert rc == 0, out
    assert "resumed from step 6" in out

    got, ref = committed(run_dir), reference.committed
    assert sorted(got) == sorted(ref) == list(range(1, 8))
    for step in ref:  # the same samples, shard by shard (a digest per shard, in order)
        assert got[step][1] == ref[step][1], step
        assert len(got[step][1]) == 2
    for step in (1, 2, 3):  # trained by the reference run itself: bit for bit
        assert got[step][0] == ref[step][0]
    for step in range(4, 8):
        assert math.isclose(got[step][0], ref[step][0], rel_tol=LOSS_RTOL), (
            step,
            got[step][0],
            ref[step][0],
        )
    print(
        "elastic loss deviation (relative, steps 4-7): "
        + ", ".join(f"{abs(got[s][0] / ref[s][0] - 1):.1e}" for s in range(4, 8))
    )
    in_effect = [
        r.data["step"] for r in records_in_effect(read_log(run_dir)) if r.type == "step_committed"
    ]
    assert in_effect == list(range(1, 8))
    assert in_effect.count(5) == 1  # each step committed once, the failed attempt's undone
    changes = _placement_changes(run_dir)
    assert [(c["old_world_size"], c["new_world_size"]) for c in changes] == [(2, 1), (2, 1), (1, 2)]
    assert [c["shard_map"] for c in changes] == [[[0, 1]], [[0, 1]], [[0], [1]]]
    assert {c["shards"] for c in changes} == {2}
    assert [c["resumed_from_step"] for c in changes] == [3, 3, 6]
    rc, vout = verify(run_dir)
    assert rc == 0, vout
    assert "shards: 2 per step, " in vout
    assert "at step 3: 2 -> 1 workers, shards [[0, 1]]" in vout
    assert "at step 6: 1 -> 2 workers, shards [[0], [1]]" in vout
    rc, shown = _cli(capsys, "events", str(run_dir), "--timeline")
    assert rc == 0, shown
    assert "placement_changed" in shown and "workers 1 -> 2" in shown
    assert "on 1 data-parallel worker(s) (was 2)" in shown
    for step in (2, 5, 7):  # before, while and after one worker trained both shards
        rc, shown = _cli(capsys, "samples", str(run_dir), "--step", str(step))
        assert rc == 0, shown
        assert "logical rank 1:" in shown, shown


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from sft_runtime.runtime.cli.main import main as cli_main

    capsys.readouterr()
    rc = cli_main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_a_same_size_resume_of_an_elastic_run_is_bit_for_bit(
    reference, demo_data, tmp_path, capsys
):
    """The control: stating the shards the run already has changes nothing."""
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    rc, out = train(run_dir, demo_data, capsys, "data.elastic.shards=2")
    assert rc == 0, out
    assert committed(run_dir) == reference.committed
    assert _placement_changes(run_dir) == []


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        # 12 conversations split over 3 workers, but the run's 2 shards do not
        (
            ("cluster.workers_per_node=3", "policy.train_global_batch_size=12"),
            "do not divide the run's data.elastic.shards=2",
        ),
        (("data.elastic.shards=4",), "data.elastic.shards: 2 -> 4"),
        (("data.elastic.shards=2", "cluster.workers_per_node=3"), "data.elastic.shards=2"),
        (("cluster.workers_per_node=1", "sft.seed=8"), "sft.seed: 7 -> 8"),
    ],
    ids=["workers-do-not-divide", "shards-changed", "shards-stated", "seed-changed"],
)
def test_a_resume_that_cannot_keep_the_samples_is_refused_before_ray(
    reference, demo_data, tmp_path, capsys, monkeypatch, overrides, named
):
    from sft_runtime.runtime.launch import setup

    def refuse(*_a, **_k):
        raise AssertionError("Ray was reached: the refusal must come before it")

    monkeypatch.setattr(setup, "ensure_ray", refuse)
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    rc, out = train(run_dir, demo_data, capsys, *overrides)
    assert rc == 2, out
    assert named in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize("kind", ["fsdp", "hf"])
def test_the_same_samples_with_fsdp_and_with_a_hugging_face_model(
    request, demo_data, tmp_path, capsys, kind
):
    """FSDP2's weights and optimizer resharded by DCP from 2 ranks to 1 and back; the tiny
    Llama packed (rows of two shards share a rank's micro-batches)."""
    from tests.support.fixtures import HF_STEPS, hf_overrides
    from tests.support.reliability import FSDP, STEPS

    if kind == "fsdp":
        reference, overrides, steps, first = (
            request.getfixturevalue("fsdp_reference"),
            FSDP,
            STEPS,
            3,
        )
    else:
        folder = request.getfixturevalue("tiny_llama")
        reference = request.getfixturevalue("hf_reference")
        overrides, steps, first = hf_overrides(folder), HF_STEPS, 2
    last = steps - 1  # one worker trains first+1..last and saves there; two the rest
    run_dir = rewind_copy(reference, tmp_path / "run", first)
    rc, out = train(
        run_dir,
        demo_data,
        capsys,
        *overrides,
        ONE_WORKER,
        f"sft.max_num_steps={last}",
        f"checkpointing.save_period={last - first}",
    )
    assert rc == 0, out
    rc, out = train(run_dir, demo_data, capsys, *overrides, f"sft.max_num_steps={steps}")
    assert rc == 0, out
    assert f"resumed from step {last}" in out
    got, ref = committed(run_dir), reference.committed
    assert sorted(got) == sorted(ref) == list(range(1, steps + 1))
    for step in ref:
        assert got[step][1] == ref[step][1], step
        assert math.isclose(got[step][0], ref[step][0], rel_tol=LOSS_RTOL), step
    deviation = max(abs(got[s][0] / ref[s][0] - 1) for s in ref)
    print(f"{kind}: largest relative loss deviation {deviation:.1e}")
    changes = _placement_changes(run_dir)
    assert [(c["old_world_size"], c["new_world_size"]) for c in changes] == [(2, 1), (1, 2)]
    rc, vout = verify(run_dir)
    assert rc == 0, vout

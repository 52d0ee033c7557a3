"""NeMo RL's dynamic batching in real runs (Ray workers, energon loaders, gloo).

A run whose ranks split their rows into micro-batches by a token budget trains on the same
conversations as a run of fixed two-row micro-batches, and its loss is the same per-token
mean: the two agree at every step up to float rounding, replicated and sharded (FSDP2).
The micro-batches the workers run hold varying numbers of rows, and sharded ranks that plan
different numbers of them stay in step (zero-weight passes keep FSDP's collectives
matched). The plan depends only on the batch, so a resumed run repeats its steps bit for bit,
and a resume that would change the split is refused unless allowed.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from sft_runtime.events.run_diff import step_facts
from sft_runtime.runtime.config import loader_spec
from sft_runtime.runtime.data.factory import build_colocated_loader
from sft_runtime.runtime.launch.driver import run_training
from sft_runtime.runtime.workers.group import PolicyWorkerGroup
from tests.support.policy_steps import one_step
from tests.support.reliability import (
    Reference,
    committed,
    compare,
    load_weights,
    rewind_copy,
    train,
)
from tests.support.small_run import small_config

STEPS, WORLD = 4, 2  # checkpoints at steps 3 and 4
# rows of up to 256 tokens, four a rank a step: in fixed micro-batches of two rows, or as
# many as fit 256 padded tokens (rows x the longest rounded up to 32), which varies
SHAPE = (
    "data.max_input_seq_length=256",
    "policy.model.max_seq_len=256",
    "policy.train_micro_batch_size=2",
    "policy.precision=float32",
)
DYNAMIC = (
    "policy.dynamic_batching.enabled=true",
    "policy.dynamic_batching.train_mb_tokens=256",
    "policy.dynamic_batching.sequence_length_round=32",
)


def _config(run_dir: Path, data: Path, layout: str, dynamic: bool):
    sharded = f"policy.dtensor_cfg.enabled={'true' if layout == 'fsdp' else 'false'}"
    return small_config(run_dir, data, STEPS, *SHAPE, sharded, *(DYNAMIC if dynamic else ()))


@pytest.fixture(scope="module")
def run_of(ray_session, demo_data, tmp_path_factory):
    """The run dir of one layout ("replicated", "fsdp") and split, trained once a module."""
    runs: dict[tuple[str, bool], Path] = {}

    def get(layout: str, dynamic: bool) -> Path:
        if (layout, dynamic) not in runs:
            run_dir = tmp_path_factory.mktemp(f"{layout}-{dynamic}") / "run"
            summary = run_training(_config(run_dir, demo_data, layout, dynamic))
            assert summary["reason"] == "completed" and summary["total_steps"] == STEPS
            runs[layout, dynamic] = run_dir
        return runs[layout, dynamic]

    return get


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_token_budget_and_fixed_micro_batches_agree_per_step(run_of, layout):
    fixed, dynamic = step_facts(run_of(layout, False)), step_facts(run_of(layout, True))
    assert sorted(fixed) == sorted(dynamic) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        a, b = fixed[step], dynamic[step]
        assert a.digests == b.digests  # the same conversations on each rank
        assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=0)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4, abs=0)


def test_sharded_workers_run_micro_batches_of_varying_rows(demo_data, run_of, tmp_path):
    """The run's workers, driven step by step as its controller drives them, report each
    micro-batch's rows: they vary, every rank's add up to its four rows, some step gives the
    ranks different numbers of micro-batches, and the losses are the run's bit for bit."""
    config = _config(tmp_path / "run", demo_data, "fsdp", dynamic=True)
    spec = loader_spec(config, WORLD)
    group = PolicyWorkerGroup(config.policy, config.cluster, seed=config.sft.seed, name="dyn")
    try:
        group.setup_loaders(
            [partial(build_colocated_loader, spec, r, WORLD, "dyn") for r in range(WORLD)]
        )
        group.prepare_for_training()
        steps = [one_step(group) for _ in range(STEPS)]
    finally:
        group.shutdown()
    rows = [[[m["rows"] for m in rank.micro_batches] for rank in step] for step in steps]
    assert all(sum(ranks) == 4 for step in rows for ranks in step), rows
    assert len({n for step in rows for ranks in step for n in ranks}) > 1, rows
    assert any(len(step[0]) != len(step[1]) for step in rows), rows
    run = step_facts(run_of("fsdp", True))
    assert [step[0].loss for step in steps] == [run[s].loss for s in range(1, STEPS + 1)]


def test_a_resumed_token_budget_run_repeats_its_steps_bit_for_bit(run_of, demo_data, tmp_path):
    """Killed right after its step-3 checkpoint, the sharded run resumes and step 4's loss,
    the samples and the final weights are the uninterrupted run's, bit for bit."""
    done = run_of("fsdp", True)
    reference = Reference(done, STEPS, committed(done), load_weights(done, STEPS))
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    summary = run_training(_config(run_dir, demo_data, "fsdp", dynamic=True))
    assert summary["resumed_from_step"] == 3 and summary["total_steps"] == STEPS
    assert compare(run_dir, reference).mismatches == []


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        ("policy.dynamic_batching.enabled=false", "policy.dynamic_batching.enabled: true -> false"),
        (
            "policy.dynamic_batching.train_mb_tokens=512",
            "policy.dynamic_batching.train_mb_tokens: 256 -> 512",
        ),
    ],
)
def test_a_resume_that_changes_the_split_is_refused_naming_the_key(
    run_of, demo_data, tmp_path, capsys, change, shown
):
    """Another split sums the loss in another order: not the checkpoint's run bit for bit,
    so the resume stops before Ray (exit 2) and says which key changed."""
    done = run_of("fsdp", True)
    reference = Reference(done, STEPS, committed(done), {})
    run_dir = rewind_copy(reference, tmp_path / "run", 3)
    same = (*SHAPE, "policy.dtensor_cfg.enabled=true", *DYNAMIC)
    rc, out = train(run_dir, demo_data, capsys, *same, change)
    assert rc == 2, out
    errors = [line for line in out.splitlines() if line.startswith("sft-runtime train: error:")]
    assert len(errors) == 1 and shown in errors[0], out
    assert "--allow-config-change" in errors[0]

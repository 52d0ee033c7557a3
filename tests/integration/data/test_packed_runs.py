"""The global batch counts conversations, packed or not (NeMo RL's meaning): a packed run
trains each step on the unpacked run's conversations, laid out in fewer rows, and its loss is
the same per-token mean. Sharded, the ranks' packed rows differ in number, and every rank still
runs as many micro-batches as the busiest one, so FSDP's collectives match."""

from __future__ import annotations

import pytest

from sft_runtime.events import read_log
from sft_runtime.events.run_diff import step_facts
from sft_runtime.runtime.config import loader_spec
from sft_runtime.runtime.data.loader import ColocatedLoader
from sft_runtime.runtime.launch.driver import run_training
from tests.support.small_run import small_config

STEPS = 4
# room for two conversations a row, and a micro-batch per row: the ranks' passes then differ
SHAPE = (
    "data.max_input_seq_length=256",
    "policy.model.max_seq_len=256",
    "policy.train_micro_batch_size=1",
)


def _rows_per_rank(tmp_path, data) -> list[list[int]]:
    """Each rank's packed rows per step, read from the loaders the run builds."""
    config = small_config(
        tmp_path / "rows", data, STEPS, *SHAPE, "policy.sequence_packing.enabled=true"
    )
    out = []
    for rank in (0, 1):
        loader = ColocatedLoader(loader_spec(config, 2), rank, 2, "rows")
        loader.setup(None)
        try:
            rows = []
            for _ in range(STEPS):
                loader.load()
                rows.append(loader.active_batch.num_rows)
                loader.commit()
        finally:
            loader.close()
        out.append(rows)
    return out


def _run(tmp_path, data, name: str, *overrides: str):
    run_dir = tmp_path / name / "run"
    summary = run_training(small_config(run_dir, data, STEPS, *SHAPE, *overrides))
    assert summary["reason"] == "completed" and summary["total_steps"] == STEPS
    rows = {rec.data["step"]: rec.data for rec in read_log(run_dir) if rec.type == "step_committed"}
    return step_facts(run_dir), rows


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_packed_and_unpacked_runs_of_the_same_conversations_agree(
    ray_session, demo_data, tmp_path, layout
):
    ranks = _rows_per_rank(tmp_path, demo_data)
    assert ranks[0] != ranks[1]  # some step gives one rank more micro-batches than the other
    extra = ("policy.dtensor_cfg.enabled=true",) if layout == "fsdp" else ()
    plain, plain_rows = _run(tmp_path, demo_data, "plain", *extra)
    packed, packed_rows = _run(
        tmp_path, demo_data, "packed", "policy.sequence_packing.enabled=true", *extra
    )
    for step in range(1, STEPS + 1):
        a, b = plain_rows[step], packed_rows[step]
        assert a["source_samples"] == b["source_samples"] == 8  # the global batch, both ways
        assert b["physical_packs"] < a["physical_packs"]  # and packing packed
        assert packed[step].loss == pytest.approx(plain[step].loss, rel=1e-5, abs=0)
        assert packed[step].grad_norm == pytest.approx(plain[step].grad_norm, rel=1e-4, abs=0)

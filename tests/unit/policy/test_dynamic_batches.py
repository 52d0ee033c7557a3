"""NeMo RL's dynamic batching without Ray: the token-budget plan, its config rules, and one
replica's step split by it.

The plan sorts a rank's rows by length (ties by index) and fills each micro-batch while its
rows x its longest row (rounded up to ``sequence_length_round``) stay within the budget; a
row over the budget goes alone. The same rows give the same plan, and a step split by it has
the loss of the same step split into fixed micro-batches, up to float rounding.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sft_runtime.runtime.config import MasterConfig, validate_config
from sft_runtime.runtime.config_files.overrides import apply_override
from sft_runtime.runtime.data.task_encoder import collate_rows
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy import replica as replica_module
from sft_runtime.runtime.policy.config import (
    DynamicBatchingConfig,
    ModelConfig,
    PolicyConfig,
)
from sft_runtime.runtime.policy.dynamic_batches import (
    padded_length,
    token_budget_micro_batches,
)
from sft_runtime.runtime.policy.model import forward_logits
from sft_runtime.runtime.policy.replica import Replica
from tests.support.encoded_rows import random_rows
from tests.support.small_run import small_raw

# ----------------------------------------------------------------------------- the plan


def _assert_a_plan(lengths: list[int], budget: int, round_to: int, plan: list[list[int]]):
    flat = [i for rows in plan for i in rows]
    assert sorted(flat) == list(range(len(lengths)))  # every row exactly once
    assert flat == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # sorted
    for rows in plan:
        assert rows  # no empty micro-batch
        widest = max(padded_length(lengths[i], round_to) for i in rows)
        assert len(rows) == 1 or len(rows) * widest <= budget


def test_a_worked_example_sorts_rounds_and_fills_up_to_the_budget():
    # padded to 32: 10 -> 32, 12 -> 32, 40 -> 64, 70 -> 96, 100 -> 128
    plan = token_budget_micro_batches([100, 10, 40, 70, 12], budget=256, round_to=32)
    assert plan == [[1, 4, 2], [3, 0]]  # 3 x 64 = 192, then 4 x 96 > 256; 2 x 128 = 256


def test_a_row_over_the_budget_forms_a_micro_batch_alone():
    plan = token_budget_micro_batches([5, 300, 6, 290], budget=64, round_to=8)
    assert plan == [[0, 2], [3], [1]]


@pytest.mark.parametrize("seed", range(20))
def test_random_rows_keep_every_rule(seed):
    rng = random.Random(seed)
    lengths = [rng.randrange(0, 200) for _ in range(rng.randrange(0, 24))]
    budget, round_to = rng.choice([64, 200, 256, 512]), rng.choice([1, 8, 64])
    plan = token_budget_micro_batches(lengths, budget, round_to)
    _assert_a_plan(lengths, budget, round_to, plan)
    assert token_budget_micro_batches(list(lengths), budget, round_to) == plan  # deterministic


def test_equal_lengths_go_by_index_and_a_larger_budget_never_adds_micro_batches():
    assert token_budget_micro_batches([7] * 5, budget=16, round_to=8) == [[0, 1], [2, 3], [4]]
    lengths = [3, 50, 9, 120, 64, 64, 2]
    counts = [len(token_budget_micro_batches(lengths, b, 16)) for b in (128, 256, 512, 1024)]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1


def test_no_rows_no_micro_batches_and_bad_arguments_refused():
    assert token_budget_micro_batches([], budget=8) == []
    with pytest.raises(ValueError, match="budget"):
        token_budget_micro_batches([1], budget=0)
    with pytest.raises(ValueError, match="negative"):
        token_budget_micro_batches([-1], budget=8)


# ----------------------------------------------------------------------------- config rules


def _config(tmp_path: Path, *overrides: str) -> MasterConfig:
    raw = small_raw(tmp_path / "run", tmp_path / "data")
    for item in ("policy.precision=float32", "policy.dtensor_cfg.enabled=false", *overrides):
        apply_override(raw, item)
    return validate_config(raw)


def _one_problem(tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(UserInputError) as err:
        _config(tmp_path, *overrides)
    problems = str(err.value).splitlines()[1:]
    assert len(problems) == 1, problems
    return problems[0]


def test_a_null_budget_is_nemo_rls_default_and_off_leaves_it_null(tmp_path):
    on = _config(tmp_path, "policy.dynamic_batching.enabled=true")
    assert on.policy.dynamic_batching.train_mb_tokens == 64 * 2  # longest row x micro-batch
    longer = _config(
        tmp_path,
        "policy.dynamic_batching.enabled=true",
        "+policy.max_total_sequence_length=128",
        "policy.model.max_seq_len=128",
    )
    assert longer.policy.dynamic_batching.train_mb_tokens == 128 * 2  # NeMo RL's product
    assert _config(tmp_path).policy.dynamic_batching.train_mb_tokens is None
    given = _config(
        tmp_path,
        "policy.dynamic_batching.enabled=true",
        "policy.dynamic_batching.train_mb_tokens=300",
        "+policy.dynamic_batching.logprob_mb_tokens=7",  # accepted, inert
    )
    assert given.policy.dynamic_batching.train_mb_tokens == 300
    # resolved once, a saved copy validates to the same config
    assert MasterConfig.model_validate(given.model_dump()) == given


def test_dynamic_batching_with_sequence_packing_is_refused_naming_both_keys(tmp_path):
    line = _one_problem(
        tmp_path, "policy.dynamic_batching.enabled=true", "policy.sequence_packing.enabled=true"
    )
    assert "policy.dynamic_batching.enabled=true" in line
    assert "policy.sequence_packing.enabled=true" in line


def test_a_budget_smaller_than_the_longest_row_is_refused_naming_the_key(tmp_path):
    line = _one_problem(
        tmp_path,
        "policy.dynamic_batching.enabled=true",
        "policy.dynamic_batching.train_mb_tokens=100",
        "policy.dynamic_batching.sequence_length_round=128",  # the 64-token row pads to 128
    )
    assert "policy.dynamic_batching.train_mb_tokens=100" in line and "at least 128" in line
    null = _one_problem(
        tmp_path,
        "policy.dynamic_batching.enabled=true",
        "policy.train_micro_batch_size=1",
        "policy.dynamic_batching.sequence_length_round=48",  # 64 pads to 96 > 64 x 1
    )
    assert "policy.dynamic_batching.train_mb_tokens (null:" in null and "at least 96" in null
    _config(  # off, the same values are no rule's business
        tmp_path,
        "policy.dynamic_batching.train_mb_tokens=100",
        "policy.dynamic_batching.sequence_length_round=128",
    )


# ----------------------------------------------------------------------------- one replica
VOCAB = 64


def _batch(lengths: list[int], seed: int = 0):
    return collate_rows(random_rows(lengths, VOCAB, seed), pad_id=0, pad_multiple=8)


def test_take_picks_rows_in_order_and_keeps_the_bookkeeping_whole():
    batch = _batch([5, 11, 40, 9])
    picked = batch.take([3, 0])
    assert torch.equal(picked.input_ids, batch.input_ids[[3, 0]])
    assert torch.equal(picked.loss_mask, batch.loss_mask[[3, 0]])
    assert picked.cu_seqlens == [[0, 9], [0, 5]]
    assert picked.source_ids == batch.source_ids  # all of the rank's samples, as `rows` keeps
    assert batch.take(range(4)) is batch
    assert batch.rows(0, 2).trimmed(8, round_to=32).input_ids.shape[1] == 32  # 11 -> 32
    assert batch.rows(2, 3).trimmed(8, round_to=32).input_ids.shape[1] == 40  # the width


def _policy(**dynamic) -> PolicyConfig:
    return PolicyConfig(
        model=ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=64),
        train_global_batch_size=6,
        train_micro_batch_size=2,
        make_sequence_length_divisible_by=8,
        precision="float32",
        dtensor_cfg={"enabled": False},
        dynamic_batching=DynamicBatchingConfig(**dynamic),
    )


def test_a_step_split_by_tokens_has_the_fixed_split_loss_and_repeats_bit_for_bit(monkeypatch):
    batch = _batch([6, 60, 9, 30, 12, 50])
    widths: list[int] = []

    def recording(model, mb):
        widths.append(int(mb.input_ids.shape[1]))
        return forward_logits(model, mb)

    monkeypatch.setattr(replica_module, "forward_logits", recording)

    def step(policy: PolicyConfig):
        replica = Replica(policy, seed=0, device=torch.device("cpu"))
        replica.begin(None, lambda: batch)
        rows = [m["rows"] for m in replica.train(batch)["micro_batches"]]
        return replica.finish(), rows, replica.files.weights()

    fixed, fixed_rows, _ = step(_policy())
    assert fixed_rows == [2.0, 2.0, 2.0]
    widths.clear()
    policy = _policy(enabled=True, train_mb_tokens=128, sequence_length_round=16)
    dynamic, rows, weights = step(policy)
    # sorted: 6, 9, 12 and 30 (4 x 32 = 128) | 50 and 60 (2 x 64 = 128)
    assert rows == [4.0, 2.0]
    assert widths == [32, 64]  # each micro-batch its longest row rounded up to 16
    assert dynamic.loss == pytest.approx(fixed.loss, rel=1e-6, abs=0)
    assert dynamic.grad_norm == pytest.approx(fixed.grad_norm, rel=1e-5, abs=0)
    again, _, weights_again = step(policy)
    assert again.loss == dynamic.loss
    assert all(torch.equal(weights[name], weights_again[name]) for name in weights)

"""The seed names of DESIGN.md exist with the promised behaviour."""

from __future__ import annotations

import pytest

import sft_runtime.runtime.sft_v2 as sft_v2
from sft_runtime.runtime.controller.loop import SEED_STEPS
from sft_runtime.states import SFTV2SaveState


def test_module_offers_the_seed_names():
    assert sft_v2.__all__ == [
        "MasterConfig",
        "SFTSingleControllerActor",
        "SFTV2ActorArgs",
        "SFTV2SaveState",
        "setup_sft_v2",
    ]
    assert sft_v2.LOADER_LATENCY_MAX_KEY == "loader_latency_max"
    assert sft_v2.POLICY_TIME_KEY == "policy_time"
    assert sft_v2.TOTAL_STEP_TIME_KEY == "total_step_time"
    assert sft_v2.VALID_TOKENS_PER_SECOND_KEY == "valid_tokens_per_second"
    teed = {m.key: (m.instrument, m.unit) for m in sft_v2.SFT_V2_TEED_METRICS}
    assert teed == {
        "loader_latency_max": ("rl.sft_v2.loader.latency.max", "s"),
        "policy_time": ("rl.sft_v2.policy.duration", "s"),
        "total_step_time": ("rl.sft_v2.step.duration", "s"),
        "valid_tokens_per_second": ("rl.sft_v2.valid_tokens_per_second", "{token}/s"),
    }
    seed_steps = (
        "_setup_loaders",
        "_load_envelopes",
        "_run_train_step",
        "_policy_metrics",
        "_owner_call",
        "_loader_state_dicts",
        "_should_save",
        "_checkpoint_metric",
        "_save_checkpoint",
        "_close_loaders",
    )
    assert SEED_STEPS == seed_steps  # the loop's list is the specification's
    for name in ("run", "run_with_trace_context", *seed_steps):
        assert callable(getattr(sft_v2.SFTController, name))
    fields = set(sft_v2.SFTV2ActorArgs.__dataclass_fields__)
    assert fields == {
        "trainer",
        "loss_fn",
        "train_cluster",
        "placement_plan",
        "save_state",
        "loader_states",
    }


def test_initial_and_restored_save_state():
    state = sft_v2._initial_save_state("abc")
    assert state == SFTV2SaveState(0, 0, 0, "abc")
    saved = {
        "total_steps": 5,
        "consumed_samples": 40,
        "total_valid_tokens": 900,
        "placement_hash": "abc",
    }
    assert sft_v2._restore_save_state(saved, placement_hash="abc").total_steps == 5


def test_restore_refuses_a_changed_placement_naming_both_hashes():
    saved = {
        "total_steps": 5,
        "consumed_samples": 40,
        "total_valid_tokens": 900,
        "placement_hash": "old1",
    }
    with pytest.raises(ValueError, match="old1.*new2"):
        sft_v2._restore_save_state(saved, placement_hash="new2")


def test_restoring_nothing_gives_the_initial_state():
    assert sft_v2._restore_save_state(None, placement_hash="h") == SFTV2SaveState(0, 0, 0, "h")


def test_missing_counters_start_from_their_initial_values_and_unknown_keys_are_ignored():
    saved = {"total_steps": 7, "placement_hash": "h", "from_a_newer_version": [1, 2]}
    assert sft_v2._restore_save_state(saved, placement_hash="h") == SFTV2SaveState(7, 0, 0, "h")
    state = SFTV2SaveState(3, 24, 500, "h")
    assert sft_v2._restore_save_state(state, placement_hash="h") == state


def test_the_placement_is_checked_before_the_counters_are_read():
    # counters that do not even parse: the placement error comes first and names both hashes
    saved = {"total_steps": "not a number", "placement_hash": "old1"}
    with pytest.raises(ValueError, match="placement_hash old1 != current placement_hash new2"):
        sft_v2._restore_save_state(saved, placement_hash="new2")
    with pytest.raises(ValueError, match="saved placement_hash None != current"):
        sft_v2._restore_save_state({"total_steps": 1}, placement_hash="new2")


def test_bad_input_is_a_value_error_that_embedding_code_can_catch(tmp_path):
    from sft_runtime.runtime.config import load_config
    from sft_runtime.runtime.errors import UserInputError

    assert issubclass(UserInputError, ValueError)
    try:
        load_config(tmp_path / "missing.yaml")
    except ValueError as exc:  # what code written against the reference catches
        assert "no such config file" in str(exc)
    else:
        raise AssertionError("a missing config file was accepted")

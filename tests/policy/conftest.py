"""Fixtures of the policy-worker tests: a tiny model, a 2-worker CPU cluster, the source.

The synthetic source lives in ``tests/policy/sources.py``, which Ray workers cannot import
(``tests`` is not a package). It is loaded here under a unique module name and registered
with cloudpickle by value, so `functools.partial(SyntheticSource, ...)` reaches the workers
whole.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from runtime.policy.config import ClusterConfig, ModelConfig, PolicyConfig

_NAME = "policy_test_sources"


def _load_sources():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).with_name("sources.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return module


sources = _load_sources()
ROWS_PER_RANK, SEQ_LEN, VOCAB = sources.ROWS_PER_RANK, sources.SEQ_LEN, sources.VOCAB


@pytest.fixture(scope="session")
def policy_cfg() -> PolicyConfig:
    return PolicyConfig(
        model=ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ_LEN),
        train_global_batch_size=2 * ROWS_PER_RANK,
        train_micro_batch_size=2,
        max_grad_norm=1.0,
        optimizer={"lr": 3e-3, "weight_decay": 0.01},
        scheduler={"kind": "cosine", "warmup_steps": 3, "total_steps": 10, "min_lr": 1e-4},
        make_sequence_length_divisible_by=8,
    )


@pytest.fixture(scope="session")
def cluster_cfg() -> ClusterConfig:
    return ClusterConfig(
        workers_per_node=2,
        cpus_per_worker=0.5,
        num_threads_per_worker=1,
        dist_timeout_s=30,
        call_timeout_s=60,
        placement_timeout_s=30,
    )

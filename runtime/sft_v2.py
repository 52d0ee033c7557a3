"""The public face of sft-runtime: the seed API that DESIGN.md and users rely on, re-exported
from where each name is defined."""

from __future__ import annotations

# The private seed names are re-exported here for the specification's tests.
from sft_runtime.runtime.config import MasterConfig, _max_train_steps  # noqa: F401
from sft_runtime.runtime.controller.actor import SFTSingleControllerActor
from sft_runtime.runtime.controller.loop import SFTController  # noqa: F401
from sft_runtime.runtime.data.bring import bring_data  # noqa: F401 - NeMo RL's data files
from sft_runtime.runtime.launch.setup import (  # noqa: F401
    SFTV2ActorArgs,
    _initial_save_state,
    _restore_save_state,
    setup_sft_v2,
)
from sft_runtime.runtime.metrics.step_metrics import (  # noqa: F401
    LOADER_LATENCY_MAX_KEY,
    POLICY_TIME_KEY,
    SFT_V2_TEED_METRICS,
    TOTAL_STEP_TIME_KEY,
    VALID_TOKENS_PER_SECOND_KEY,
    TeedMetric,
)
from sft_runtime.states import SFTV2SaveState

__all__ = [
    "MasterConfig",
    "SFTSingleControllerActor",
    "SFTV2ActorArgs",
    "SFTV2SaveState",
    "setup_sft_v2",
]

"""sft-runtime: an event-sourced runtime for supervised fine-tuning on Ray.

Everything installs under this one name (``sft_runtime.runtime``, ``sft_runtime.states``,
``sft_runtime.events``, ``sft_runtime.traces``), so the runtime sits beside any other
package. The seed API lives in `sft_runtime.sft_v2`; its names are offered here too, but
loaded on first use, so ``import sft_runtime.events`` or ``sft_runtime.states`` (replay and
inspection) never pulls in ray or torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_SEED_NAMES = (
    "MasterConfig",
    "SFTSingleControllerActor",
    "SFTV2ActorArgs",
    "SFTV2SaveState",
    "setup_sft_v2",
)

__all__ = list(_SEED_NAMES)


def __getattr__(name: str) -> Any:
    if name == "sft_v2":
        return import_module("sft_runtime.sft_v2")
    if name in _SEED_NAMES:
        return getattr(import_module("sft_runtime.sft_v2"), name)
    raise AttributeError(f"module 'sft_runtime' has no attribute {name!r}")

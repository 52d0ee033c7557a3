"""`SFTV2SaveState` and the pure fold that rebuilds it from the log.

The save state is what a resume must agree on: how many optimizer steps are done, how many
source samples and supervised tokens they consumed, and the placement the loaders were
sharded for. It changes only when a step commits, so it always sits on an optimizer-step
boundary. The fold that rebuilds it from the log is `states.fold`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SFTV2SaveState:
    """Training progress at an optimizer-step boundary."""

    total_steps: int = 0
    consumed_samples: int = 0
    total_valid_tokens: int = 0
    placement_hash: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def overlay(self, data: dict[str, Any]) -> SFTV2SaveState:
        """This state with the fields ``data`` has; unknown keys are ignored."""
        values = self.to_dict()
        for key in values:
            if data.get(key) is not None:
                values[key] = str(data[key]) if key == "placement_hash" else int(data[key])
        return SFTV2SaveState(**values)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SFTV2SaveState:
        missing = [
            k for k in ("total_steps", "consumed_samples", "total_valid_tokens") if k not in data
        ]
        if missing:
            raise ValueError(f"save state is missing {', '.join(missing)}")
        return cls(
            total_steps=int(data["total_steps"]),
            consumed_samples=int(data["consumed_samples"]),
            total_valid_tokens=int(data["total_valid_tokens"]),
            placement_hash=str(data.get("placement_hash", "")),
        )


def initial_save_state(placement_hash: str = "") -> SFTV2SaveState:
    return SFTV2SaveState(placement_hash=placement_hash)

"""Learning-rate schedule: linear warmup, then constant or cosine decay.

The schedule is a pure function of the optimizer-step count, so its whole checkpointed
state is that one integer (saved next to the optimizer state) and a resumed run computes
bitwise the same LR as an uninterrupted one.
"""

from __future__ import annotations

import math

from sft_runtime.runtime.policy.config import SchedulerConfig


def lr_at(step: int, base_lr: float, cfg: SchedulerConfig) -> float:
    """LR used by optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return base_lr
    total = cfg.total_steps or 1
    decay_steps = max(total - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (base_lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))

"""energon's loader position, taken so that a resume delivers exactly the next batch.

energon asks each worker process for its checkpoint at the last sample that worker
delivered. A worker asked before its iterator stored its first checkpoint answers with a
state one sample ahead (seen about one time in three right after the first batch with two
workers), so a resume from that state would skip the worker's next batch. A worker that has
delivered nothing since the loader was built is exactly where the loader started it: at the
state restored into it, or at the initial one. Both are known in this process without asking
the worker, so `energon_position` takes them from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def energon_position(loader: Any, start_counters: Sequence[int]) -> Any:
    """``loader.save_state_rank()``, with every worker whose delivery counter has not moved
    since ``start_counters`` (read when the loader was built) set to its starting state."""
    state = loader.save_state_rank()
    if state is None or getattr(loader, "num_workers", 0) < 2:
        return state
    counters = list(loader._worker_sample_counters)
    idle = [
        w for w, (now, then) in enumerate(zip(counters, start_counters, strict=True)) if now == then
    ]
    if idle:
        from megatron.energon.savable_loader import SavableDatasetCheckpoint

        initial = loader.dataset.get_initial_checkpoint()
        for w in idle:
            state.worker_states[w] = (
                SavableDatasetCheckpoint(state=None, offset=0) if initial is None else initial[w]
            )
    return state

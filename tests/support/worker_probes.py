"""What tests and benchmarks read off live workers, through the worker's one `probe` call.

None of this is part of a run, so none of it is in the worker protocol: each function sends
a small reader that the worker applies to itself. The readers are pickled by value, so a
worker process need not be able to import ``tests``.
"""

from __future__ import annotations

import resource
import sys
from functools import partial
from typing import Any

import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _weights(worker: Any, include_frozen: bool) -> dict[str, Any]:
    return worker.state.get_weights(include_frozen=include_frozen)


def weights(group: Any, *, ranks: Any = "all", include_frozen: bool = False) -> list[dict]:
    """A CPU copy of each rank's weights (with LoRA the adapters, or with ``include_frozen``
    the frozen base beside them)."""
    return group.probe(partial(_weights, include_frozen=include_frozen), ranks=ranks)


def _optimizer_state(worker: Any) -> dict[str, Any]:
    return worker.state.get_optimizer_state()


def optimizer_state(group: Any, *, ranks: Any = "all") -> list[dict]:
    """A CPU copy of each rank's optimizer and schedule state."""
    return group.probe(_optimizer_state, ranks=ranks)


def _loader_state(worker: Any) -> Any:
    return worker.loader.require().state_dict()


def loader_states(group: Any) -> list:
    """Each owner's loader state, unpickled (a list per owner of several shards)."""
    return group.probe(_loader_state, ranks="owners")


def _local_storage(worker: Any) -> dict[str, int]:
    return worker.replica.files.local_storage()


def local_storage(group: Any) -> list[dict[str, int]]:
    """Elements of parameters, gradients and optimizer state each rank holds (sharded: its
    slices) beside the whole model's."""
    return group.probe(_local_storage)


def _peak_rss(worker: Any) -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_rss_bytes(group: Any) -> list[int]:
    """Peak resident memory of each worker process."""
    return group.probe(_peak_rss)


def _heap_env(worker: Any) -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


def heap_env(group: Any) -> list[dict[str, str]]:
    """The glibc malloc variables each worker process started with."""
    return group.probe(_heap_env)

"""`PolicyWorker`: the Ray actor class of one data-parallel rank, with no torch in sight.

A process that receives an actor's handle loads the actor's class (Ray reads the methods
off it), and with the class its bases and the modules they come from. The controller holds
every worker's handle and trains nothing; when the actor class was the worker itself, that
load imported torch into the controller on its start (about 1.7 s and 70 MiB on a 2-core
machine, see bench/run_tree.py). So the actor class is this thin one: the module imports
neither torch nor anything that does, and each method hands its call to the
`PolicyWorkerBase` the constructor builds in the worker's own process.

The methods are `PolicyWorkerBase`'s public ones, named here because reading them off that
class would import it (tests/unit/workers/test_worker_actor.py checks that the two agree).
Their signatures are the worker's; the calls the runtime makes on them are typed in
`runtime.workers.group` (`WorkerCalls`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

WRITES_GROUP = "checkpoint_writes"  # the concurrency group of `checkpoint_written`

METHODS = (
    "rendezvous_address",
    "init_distributed",
    "setup_telemetry",
    "flush_telemetry",
    "node_id",
    "ping",
    "probe",
    "validate",
    "setup_sft_dataloader",
    "commit_sft_batch",
    "abort_sft_batch",
    "sft_dataloader_state_bytes",
    "close_sft_dataloader",
    "prepare_for_training",
    "train_sft_step",
    "start_sft_step",
    "finish_train_step",
    "abort_train_step",
    "save_checkpoint",
    "begin_checkpoint",
    "load_checkpoint",
)
# not queued behind the steps: a save's files are confirmed while the next step runs
OWN_GROUP = {"checkpoint_written": WRITES_GROUP}


class PolicyWorker:
    """One DP rank's worker, built in the actor's process on its start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from sft_runtime.runtime.workers.worker import PolicyWorkerBase

        self.worker = PolicyWorkerBase(*args, **kwargs)


def _forward(name: str) -> Callable[..., Any]:
    def call(self: PolicyWorker, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, name)(*args, **kwargs)

    call.__name__ = name
    call.__qualname__ = f"PolicyWorker.{name}"
    return call


for _name in METHODS:
    setattr(PolicyWorker, _name, _forward(_name))
for _name, _group in OWN_GROUP.items():
    setattr(PolicyWorker, _name, ray.method(concurrency_group=_group)(_forward(_name)))

# ray.remote's typed overloads leave out actor options (concurrency_groups, ...) it accepts
POLICY_WORKER = ray.remote(  # pyright: ignore[reportCallIssue]
    concurrency_groups={WRITES_GROUP: 1}, enable_task_events=False
)(PolicyWorker)

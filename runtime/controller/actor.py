"""`SFTSingleControllerActor`: the controller made a Ray actor (`runtime.sft_v2` re-exports it).

Threaded (``max_concurrency=2``) so that `request_stop` reaches a controller busy in `run`;
no CPU of its own, and never restarted by Ray (a resume is the driver's decision, from the
log).
"""

from __future__ import annotations

import ray

from sft_runtime.runtime.controller.loop import SFTController

# ray.remote's typed overloads leave out actor options (max_concurrency, ...) it accepts
SFTSingleControllerActor = ray.remote(  # pyright: ignore[reportCallIssue]
    num_cpus=0, max_concurrency=2, max_restarts=0, enable_task_events=False
)(SFTController)

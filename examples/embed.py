"""Embed sft-runtime in your own program: build the config in Python, train, read the log.

Run from the repository root:  python examples/embed.py [RUN_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import ray

from sft_runtime.events import history, read_log
from sft_runtime.runtime.cli.demo import demo_config
from sft_runtime.runtime.data.demo import build_demo_dataset
from sft_runtime.sft_v2 import SFTSingleControllerActor, setup_sft_v2
from sft_runtime.states import replay


def main(run_dir: Path) -> None:
    data = run_dir / "data"
    if not (data / ".nv-meta").is_dir():
        build_demo_dataset(data, num_samples=256)
    config = demo_config(run_dir, data, steps=8)  # a MasterConfig; any field can be changed
    args = setup_sft_v2(config, None)  # starts an embedded Ray unless cluster.address is set
    try:
        controller = SFTSingleControllerActor.remote(config, args)
        summary = ray.get(controller.run.remote())
        print("summary:", summary)
    finally:
        args.trainer.shutdown()
        ray.shutdown()
    print("save state replayed from the log:", replay(run_dir))
    for attempt in history(read_log(run_dir)).attempts:
        print(
            f"attempt {attempt.number}: steps {attempt.first_step}-{attempt.last_step}, "
            f"checkpoints {attempt.checkpoints}, {attempt.outcome}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/embed"))

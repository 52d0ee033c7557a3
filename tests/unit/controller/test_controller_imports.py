"""The controller never imports torch: its loop drives workers, it trains nothing.

torch costs a process about 190 MiB and seconds of import. The workers' actor class that
Ray loads when the controller unpickles their handles is torch-free
(`runtime/workers/actor.py`), so this keeps the loop, the config, the resume checks and
the metrics backends a default config turns on (TensorBoard, where it is installed) from
adding imports of their own. The config is built here and handed over pickled, as Ray
hands it to the controller actor (unpickling a config checks nothing again).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

from tests.support.small_run import small_config

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import pickle, sys
sys.path.insert(0, {root!r})
config = pickle.loads(open({config!r}, "rb").read())
import sft_runtime.runtime.controller.actor  # what Ray imports for the controller actor
from sft_runtime.runtime.data.placement import build_placement_plan
from sft_runtime.runtime.launch.setup import SFTV2ActorArgs
from sft_runtime.runtime.controller.loop import SFTController
from sft_runtime.states import SFTV2SaveState
from tests.unit.controller.test_controller_errors import StubGroup

plan = build_placement_plan(
    {{"data_parallel": 2, "tensor_parallel": 1, "pipeline_parallel": 1, "context_parallel": 1}}
)
args = SFTV2ActorArgs(
    trainer=StubGroup(), loss_fn=None, train_cluster={{}}, placement_plan=plan,
    save_state=SFTV2SaveState(0, 0, 0, plan.placement_hash), loader_states=None,
)
summary = SFTController(config, args).run()
print("steps", summary["total_steps"], "torch", "torch" in sys.modules)
"""


def test_a_run_of_the_controller_loop_with_tensorboard_on_leaves_torch_unimported(tmp_path):
    config = small_config(tmp_path / "run", tmp_path / "data", 4, "logger.tensorboard_enabled=true")
    assert config.logger.tensorboard_enabled
    blob = tmp_path / "config.pickle"
    blob.write_bytes(pickle.dumps(config))
    code = CHILD.format(root=str(ROOT), config=str(blob))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["steps", "4", "torch", "False"], done.stdout

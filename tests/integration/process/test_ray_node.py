"""A Ray this process started hands its workers its environment: the fault variables an
actor needs are left out of its options there, and handed where the workers would not
have them (set after the start, or a Ray started by someone else). Run in a child process
with a real embedded Ray, whose actor reports what it sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, os
import ray
from sft_runtime.runtime.launch.setup import ensure_ray
from sft_runtime.runtime.policy.cluster_config import ClusterConfig
from sft_runtime.runtime.process.faults import actor_fault_options

@ray.remote(num_cpus=0)
class Probe:
    def fault(self):
        return os.environ.get("SFT_RUNTIME_FAULT")

def seen(options):
    return ray.get(Probe.options(**options).remote().fault.remote())

out = {}
os.environ["SFT_RUNTIME_FAULT"] = "stepping:after_record@99"
ensure_ray(ClusterConfig(workers_per_node=1))
options = actor_fault_options()
out["embedded"] = [options, seen(options)]
os.environ["SFT_RUNTIME_FAULT"] = "worker:train@2"  # changed after the start
options = actor_fault_options()
out["changed"] = [options, seen(options)]
ray.shutdown()
ray.init(address="local", num_cpus=1, include_dashboard=False)  # not this runtime's start
os.environ["SFT_RUNTIME_FAULT"] = "stepping:after_record@99"
options = actor_fault_options()
out["other"] = [options, seen(options)]
ray.shutdown()
print(json.dumps(out))
"""


def test_an_embedded_rays_workers_inherit_the_fault_variables_and_the_rest_are_handed():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "SFT_"))}
    env["RAY_AUTH_MODE"] = "disabled"
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["embedded"] == [{}, "stepping:after_record@99"]
    handed = {"runtime_env": {"env_vars": {"SFT_RUNTIME_FAULT": "worker:train@2"}}}
    assert out["changed"] == [handed, "worker:train@2"]
    handed = {"runtime_env": {"env_vars": {"SFT_RUNTIME_FAULT": "stepping:after_record@99"}}}
    assert out["other"] == [handed, "stepping:after_record@99"]

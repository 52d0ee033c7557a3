"""The Ray actor class forwards every public method of the worker, and loads without torch."""

from __future__ import annotations

import inspect
import subprocess
import sys

from sft_runtime.runtime.workers.actor import METHODS, OWN_GROUP, WRITES_GROUP, PolicyWorker
from sft_runtime.runtime.workers.worker import PolicyWorkerBase


def test_the_actor_has_every_public_method_of_the_worker_and_no_other():
    public = {
        name
        for name, _ in inspect.getmembers(PolicyWorkerBase, inspect.isfunction)
        if not name.startswith("_")
    }
    assert set(METHODS) | set(OWN_GROUP) == public
    forwarded = {
        name
        for name, _ in inspect.getmembers(PolicyWorker, inspect.isfunction)
        if not name.startswith("_")
    }
    assert forwarded == public


def test_the_checkpoint_confirmation_runs_beside_the_steps():
    assert OWN_GROUP == {"checkpoint_written": WRITES_GROUP}
    assert PolicyWorker.checkpoint_written.__ray_concurrency_group__ == WRITES_GROUP  # type: ignore[attr-defined]


def test_a_call_reaches_the_worker_with_its_arguments():
    actor = PolicyWorker.__new__(PolicyWorker)
    seen = []

    class Worker:
        def probe(self, look, *, _otel_carrier=None):
            seen.append(_otel_carrier)
            return look(self)

    actor.worker = Worker()  # type: ignore[assignment]
    assert actor.probe(type, _otel_carrier={"traceparent": "x"}) is Worker  # type: ignore[attr-defined]
    assert seen == [{"traceparent": "x"}]


def test_the_actor_module_imports_no_torch():
    code = (
        "import sys; import sft_runtime.runtime.workers.actor; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

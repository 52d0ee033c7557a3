"""Writing one checkpoint directory: policy files, loader states, config, training info.

Everything goes into ``tmp_step_<N>`` first; `CheckpointDir.commit` fsyncs and renames it,
so a crash at any moment leaves either a complete ``step_<N>`` or a stale temp directory
that the next start removes.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from sft_runtime.events import CheckpointSaved
from sft_runtime.runtime.checkpoint.loader_states import dumps_loader_states
from sft_runtime.runtime.checkpoint.store import LOADERS_NAME, CheckpointDir
from sft_runtime.runtime.controller.faults import fault_point
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.states import SFTV2SaveState

CHECKPOINT_FORMAT = 1


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, say): the run stops, nothing saved is lost."""


def state_metric(metric_name: str | None, metrics: dict[str, Any]) -> float | None:
    """The value of ``train:<key>`` among a step's metrics; unknown keys list the known."""
    if metric_name is None:
        return None
    key = metric_name.removeprefix("train:")
    if key not in metrics:
        known = ", ".join(f"train:{k}" for k in sorted(metrics))
        raise UserInputError(
            f"checkpointing.metric_name {metric_name!r} is not a training metric; "
            f"available: {known}"
        )
    return float(metrics[key])


def write_checkpoint(
    ckpt: CheckpointDir,
    *,
    save_state: SFTV2SaveState,
    save_policy: Callable[[Path], list[bytes]],
    config: dict[str, Any] | str,
    info: dict[str, Any],
    attempt: int | None = None,
) -> Path:
    """Write and commit ``step_<total_steps>``; the temp directory never survives a failure."""
    step = save_state.total_steps
    tmp = ckpt.begin(step)
    try:
        loader_states = save_policy(tmp / "policy")
        fault_point("saving:after_weights", step=step, attempt=attempt)
        (tmp / LOADERS_NAME).write_bytes(dumps_loader_states(loader_states))
        (tmp / "config.yaml").write_text(config if isinstance(config, str) else config_yaml(config))
        full_info = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "save_state": save_state.to_dict(),
            "logical_world_size": len(loader_states),
            "time": time.time(),
            **info,
        }
        fault_point("saving:before_rename", step=step, attempt=attempt)
        final = ckpt.commit(step, tmp, full_info)
        fault_point("saving:after_rename", step=step, attempt=attempt)
        return final
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            exc.errno,
            f"could not write checkpoint {ckpt.path(step)} ({exc.strerror or exc}); the "
            "previous checkpoints and the event log are unchanged",
        ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def config_yaml(config: dict[str, Any]) -> str:
    """The run's config as written into every checkpoint (render once per run: ~2 ms)."""
    return yaml.safe_dump(config, sort_keys=False)


def checkpoint_info(
    config: Any, kinds: tuple[str, ...], metric: float | None, attempt: int | None
) -> dict[str, Any]:
    """What ``training_info.json`` records besides the save state."""
    return {
        "kinds": list(kinds),
        "metric_name": config.checkpointing.metric_name,
        "metric": metric,
        "attempt": attempt,
        "num_threads_per_worker": config.cluster.num_threads_per_worker,
    }


def save_policy_files(
    group: Any,
    policy_dir: Path,
    *,
    save_optimizer: bool,
    final: bool,
    carrier: dict,
    commit_first: bool = False,
    then: Callable[[], None] | None = None,
) -> list[bytes]:
    """Every worker writes its share of the policy files (weights, optimizer, its RNG) and
    every loader owner returns its pickled state, in one wave of calls and one wait.

    ``commit_first`` commits the last step's batches before the states are taken (a commit
    that no later step start carried); ``then`` runs once the wave is sent (the controller
    queues the next step's start behind it). Returns the loader states in owner order.
    """
    optimizer = policy_dir / "optimizer" if save_optimizer else None
    refs = []
    if commit_first:
        refs += group.submit("commit_sft_batch", ranks="owners", _otel_carrier=carrier)
    skip = len(refs)
    refs += group.submit("sft_dataloader_state_bytes", ranks="owners", _otel_carrier=carrier)
    states = len(refs) - skip
    refs += group.submit(
        "save_checkpoint",
        str(policy_dir / "weights"),
        None if optimizer is None else str(optimizer),
        None,  # the tokenizer spec is in config.yaml
        final,
        rng_path=str(policy_dir / "rng"),
        _otel_carrier=carrier,
    )
    if then is not None:
        then()
    return group.wait("save_checkpoint", refs)[skip : skip + states]


def saved_event(
    state: SFTV2SaveState, path: Path, metric: float | None, seconds: float
) -> CheckpointSaved:
    """The ``checkpoint_saved`` record of a checkpoint of ``state`` written to ``path``."""
    return CheckpointSaved(
        step=state.total_steps,
        path=str(path),
        total_steps=state.total_steps,
        consumed_samples=state.consumed_samples,
        total_valid_tokens=state.total_valid_tokens,
        metric=metric,
        seconds=seconds,
    )

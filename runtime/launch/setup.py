"""`setup_sft_v2`: everything the controller needs, built in the driver.

Config checks that need no cluster already ran when `MasterConfig` was built; here come
the ones that need the workers (the placement plan, the DP size) and the resume state.
Whatever fails, nothing is left behind: workers and placement group are torn down.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from sft_runtime.events.errors import EventLogLocked
from sft_runtime.events.log import LOCK_NAME, acquire_lock, lock_holder
from sft_runtime.runtime.checkpoint.resume import find_resume_point
from sft_runtime.runtime.checkpoint.sharded import is_sharded
from sft_runtime.runtime.checkpoint.store import CheckpointDir
from sft_runtime.runtime.config import MasterConfig, checkpoint_root
from sft_runtime.runtime.data.integrity import check_sample_type
from sft_runtime.runtime.data.placement import DataLoaderPlacementPlan, build_placement_plan
from sft_runtime.runtime.data.tokenizer import build_tokenizer
from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.launch.ray_session import remove_session_at_exit
from sft_runtime.runtime.launch.run_lock import check_not_held
from sft_runtime.runtime.metrics.superseded import drop_superseded_rows
from sft_runtime.runtime.policy.cluster_config import ClusterConfig
from sft_runtime.runtime.process.heap import worker_heap_env
from sft_runtime.runtime.process.liveness import driver_alive, driver_identity
from sft_runtime.runtime.process.niceness import embedded_ray_env
from sft_runtime.runtime.process.ray_node import record_started_env
from sft_runtime.runtime.resume.config_change import ConfigRecord, resume_config, resume_notes
from sft_runtime.runtime.resume.placement_change import run_shards, with_shards, workers_change
from sft_runtime.states import SFTV2SaveState, initial_save_state
from sft_runtime.traces.spans import SETUP_SPANS, traced

LOCK_WAIT_S = 15.0


class ClusterInfo(TypedDict):
    """What the driver tells the controller about where the run runs (a dict, as the seed's
    ``train_cluster`` is)."""

    world_size: int  # data-parallel workers
    node_ids: list[str]  # each worker's Ray node, in rank order
    driver_pid: int  # the controller stops when this process is gone (`check_driver`)
    driver_host: str
    config_record: ConfigRecord  # what run_started records about the config


@dataclass
class SFTV2ActorArgs:
    trainer: Any  # PolicyWorkerGroup
    loss_fn: Any
    train_cluster: ClusterInfo
    placement_plan: DataLoaderPlacementPlan
    save_state: SFTV2SaveState
    loader_states: list | None


def _initial_save_state(placement_hash: str) -> SFTV2SaveState:
    return initial_save_state(placement_hash)


def _restore_save_state(loaded: Any, *, placement_hash: str) -> SFTV2SaveState:
    """A checkpoint's save state (``None``: nothing saved, the initial state), refused when
    the loaders were sharded differently.

    The placement is checked first: counters from a differently sharded run mean other
    samples, so they are never used. Counters the saved dict lacks keep their initial
    values and keys this version does not know are ignored, so a checkpoint written by an
    older or newer version still resumes.
    """
    if loaded is None:
        return _initial_save_state(placement_hash)
    data = loaded.to_dict() if isinstance(loaded, SFTV2SaveState) else dict(loaded)
    saved_hash = data.get("placement_hash")
    if saved_hash != placement_hash:
        raise ValueError(
            f"the data placement changed since the checkpoint: saved placement_hash "
            f"{saved_hash} != current placement_hash {placement_hash}; resume with "
            "the same cluster layout, or start a new run directory"
        )
    return _initial_save_state(placement_hash).overlay(data)


def ensure_ray(cluster: ClusterConfig) -> bool:
    """Connect to ``cluster.address``/RAY_ADDRESS, or start an embedded Ray. True if started.

    ``ray.init`` waits minutes for an address where nothing answers, so a plain TCP probe
    with a short timeout runs first; a cluster with fewer live nodes than
    ``cluster.num_nodes`` is refused before anything is placed on it.
    """
    import ray

    if ray.is_initialized():
        return False
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        if address != "auto":
            _probe_address(address, cluster.connect_timeout_s)
        try:
            ray.init(address=address, logging_level="WARNING")
        except Exception as exc:  # noqa: BLE001 - any failure to connect is bad input
            raise UserInputError(f"cluster.address {address!r}: cannot connect ({exc})") from None
        try:
            _check_nodes(cluster, ray.nodes())
        except UserInputError:
            ray.shutdown()
            raise
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.update(embedded_ray_env(cluster.worker_niceness))  # inherited by the raylet
    # and so by every worker it starts, those it starts ahead of need too: the worker group
    # then finds the heap set here and hands nothing through a runtime_env, whose actors
    # would each need a process of their own (runtime/process/heap.py)
    os.environ.update(worker_heap_env())
    needed = cluster.world_size * cluster.cpus_per_worker
    env = dict(os.environ)
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)),
        include_dashboard=False,
        logging_level="WARNING",
    )
    record_started_env(env)  # every worker of this node has it: nothing in it is handed
    remove_session_at_exit()  # ours alone: a joined cluster's folder is never touched
    return True


def _probe_address(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserInputError(
            f"cluster.address {address!r}: expected HOST:PORT of the Ray head (or 'auto')"
        )
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UserInputError(
            f"cluster.address {address!r}: nothing answers at {host}:{port} within "
            f"{timeout_s:g}s ({exc.strerror or exc}); is `ray start --head` running there?"
        ) from None


def _check_nodes(cluster: ClusterConfig, nodes: list[dict]) -> None:
    alive = [n for n in nodes if n.get("Alive")]
    if len(alive) < cluster.num_nodes:
        raise UserInputError(
            f"cluster.num_nodes is {cluster.num_nodes} but the Ray cluster has {len(alive)} "
            "live node(s); start the missing nodes with `ray start --address=HEAD:PORT`"
        )


def probe_run_lock(run_dir: Path, wait_s: float = LOCK_WAIT_S) -> None:
    """Refuse early when another live run writes this run directory.

    The controller that holds the lock records its driver. When that driver is gone (a run
    killed a moment ago), its Ray actors still hold the lock for a few seconds before Ray
    reaps them, so the probe waits up to ``wait_s`` for them; a live driver, or one on
    another host, means a live run and is refused at once.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = acquire_lock(run_dir / LOCK_NAME)
        except EventLogLocked as exc:
            if time.monotonic() >= deadline or not _holder_orphaned(run_dir / LOCK_NAME):
                raise UserInputError(str(exc)) from None
            time.sleep(0.5)
            continue
        os.close(fd)
        return


def _holder_orphaned(lock: Path) -> bool:
    return driver_alive(lock_holder(lock)) is False


def setup_sft_v2(master_config: MasterConfig, tokenizer_or_processor: Any = None) -> SFTV2ActorArgs:
    """Validate, start or join Ray, build the workers and the placement plan, find the resume."""
    from sft_runtime.runtime.policy.loss import NLLLossFn
    from sft_runtime.runtime.workers.cluster import PlacementError
    from sft_runtime.runtime.workers.group import PolicyWorkerGroup

    config = master_config
    run_dir = Path(config.logger.log_dir)
    with traced(SETUP_SPANS["check"]):
        _check_data_path(config)
        if config.policy.is_hf:  # the model folder first: it may hold the tokenizer
            from sft_runtime.runtime.policy.hf_files import check_hf_weights
            from sft_runtime.runtime.policy.model_path import hf_config, is_local

            hf_path = str(config.policy.model_name)
            hf = hf_config(hf_path)
            if is_local(hf_path):  # its weight files too, before any worker opens them
                check_hf_weights(hf_path, hf)
            if config.policy.sequence_packing.enabled:
                from sft_runtime.runtime.policy.packed_attention import check_packed_attention

                check_packed_attention(hf, hf_path)
            if config.policy.dtensor_cfg.lora_cfg.enabled:
                from sft_runtime.runtime.lora.adapters import check_lora

                check_lora(hf, config.policy.dtensor_cfg.lora_cfg)
        tokenizer = tokenizer_or_processor or build_tokenizer(config.policy.tokenizer)
        check_model_covers(config, tokenizer.vocab_size)
        check_not_held(run_dir)  # another launch's driver holds it (see run_lock)
        probe_run_lock(run_dir)
    with traced(SETUP_SPANS["resume"]) as span:  # log replay and checkpoint checks
        resume = find_resume_point(run_dir, CheckpointDir(checkpoint_root(config)))
        span.set_attribute("sft.resume.step", resume.step or 0)
        config = with_shards(config, run_shards(config, resume))  # fixed at the run's start
        if resume.step:
            check_weights_layout(resume.policy_dir / "weights", config.policy.dtensor_cfg.enabled)
            if config.policy.is_hf:
                from sft_runtime.runtime.lora.base import check_base

                lora = config.policy.dtensor_cfg.lora_cfg.enabled
                check_base(resume.policy_dir / "weights", lora, config.policy.model_name)
        record = resume_config(config, run_dir, resume)  # refuses a change that may not be
        for note in resume_notes(record, resume.step):
            print(note, file=sys.stderr)
    with traced(SETUP_SPANS["ray"]):
        ensure_ray(config.cluster)
    restore = None
    if resume.step:
        policy = resume.policy_dir
        optimizer = policy / "optimizer"
        restore = {
            "weights_path": str(policy / "weights"),
            "optimizer_path": str(optimizer) if optimizer.is_dir() else None,
            "rng_path": str(policy / "rng"),
            # a thread count the user allowed to change (the RNG itself does not depend on it)
            "allow_thread_change": "cluster.num_threads_per_worker" in record.changes,
            # another number of workers: no saved RNG state is any rank's (worker_state.py)
            "reseed_rng": workers_change(config, record.changes) is not None,
        }
    # placement group, worker actors, their process group and, on resume, the checkpoint load
    with traced(SETUP_SPANS["workers"], attributes={"sft.restore": restore is not None}):
        try:
            group = PolicyWorkerGroup(
                config.policy, config.cluster, seed=config.sft.seed, restore=restore
            )
        except PlacementError as exc:
            raise UserInputError(str(exc)) from None
    try:
        plan = build_placement_plan(
            group.sharding_annotations(),
            config.data.energon.topology_mapper,
            shards=config.data.elastic.shards,
        )
        n = plan.logical_world_size
        if config.policy.train_global_batch_size % n:
            raise UserInputError(
                f"policy.train_global_batch_size ({config.policy.train_global_batch_size}) must "
                f"be divisible by the logical data-parallel size ({n})"
            )
        if resume.step:
            try:
                state = _restore_save_state(resume.save_state, placement_hash=plan.placement_hash)
            except ValueError as exc:
                raise UserInputError(str(exc)) from None
            if len(resume.loader_states) != n:
                raise UserInputError(
                    f"{resume.policy_dir.parent}: holds {len(resume.loader_states)} loader "
                    f"states for {n} logical data-parallel shards"
                )
        else:
            state = _initial_save_state(plan.placement_hash)
        # the rows of the steps this attempt executes again go (the log keeps their values)
        drop_superseded_rows(run_dir, state.total_steps)
        return SFTV2ActorArgs(
            trainer=group,
            loss_fn=NLLLossFn(),
            train_cluster=ClusterInfo(
                world_size=group.world_size,
                node_ids=group.node_ids(),
                driver_pid=os.getpid(),
                driver_host=driver_identity()["driver_host"],
                config_record=record,
            ),
            placement_plan=plan,
            save_state=state,
            loader_states=resume.loader_states if resume.step else None,
        )
    except BaseException:
        group.shutdown()
        raise


def check_weights_layout(weights: Path, fsdp: bool) -> None:
    """A sharded checkpoint resumes only sharded, and a whole one only unsharded (an export
    turns either into a model folder a new run starts from)."""
    if is_sharded(weights) != fsdp:
        saved = "sharded (FSDP2)" if is_sharded(weights) else "unsharded"
        raise UserInputError(
            f"{weights}: the checkpoint is {saved} but "
            f"policy.dtensor_cfg.enabled={str(fsdp).lower()}; "
            f"resume with policy.dtensor_cfg.enabled={str(not fsdp).lower()}, or export the "
            "checkpoint "
            "and start a new run from it"
        )


def check_model_covers(config: MasterConfig, tokenizer_vocab: int) -> None:
    """The model has an embedding for every token id and a position for every token of a row
    (an id past the vocabulary is an index error deep in a worker; for an HF model these
    sizes come from its own config.json, read here without loading a weight)."""
    model, length = config.policy.model, config.data.max_input_seq_length
    name = config.policy.model_name
    if name is not None:
        from sft_runtime.runtime.policy.model_path import hf_config

        hf = hf_config(name)
        vocab, vocab_key = int(hf.vocab_size), f"{name}/config.json vocab_size"
        positions = getattr(hf, "max_position_embeddings", None)
        positions_key = f"{name}/config.json max_position_embeddings"
    else:
        vocab, vocab_key = model.vocab_size, "policy.model.vocab_size"
        positions, positions_key = model.max_seq_len, "policy.model.max_seq_len"
    if tokenizer_vocab > vocab:
        raise UserInputError(
            f"{vocab_key} ({vocab}) is smaller than the tokenizer's vocabulary ({tokenizer_vocab})"
        )
    if positions is not None and length > int(positions):
        raise UserInputError(
            f"data.max_input_seq_length ({length}) exceeds {positions_key} ({positions})"
        )


def _check_data_path(config: MasterConfig) -> None:
    train = config.data.train
    if train.path is None or train.virtual_epoch_length is None:
        raise UserInputError(
            "data.train.data_path is not prepared yet: pass the config through "
            "sft_runtime.sft_v2.bring_data(config) first, and its result to the controller"
        )
    path = Path(train.path)
    if not (path / ".nv-meta").is_dir():
        raise UserInputError(
            f"data.train.path {str(path)!r} is not a prepared energon data set (no .nv-meta); "
            "create one with `sft-runtime demo-data DIR` or `sft-runtime prepare-data IN.jsonl DIR`"
        )
    check_sample_type(path)

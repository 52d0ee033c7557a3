"""The rendezvous store holds its port from the moment the port is chosen, and the ranks
meet through it (real processes, gloo)."""

from __future__ import annotations

import errno
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sft_runtime.runtime.policy import rendezvous

WORLD = 2


def _rank(rank: int, port: int, out: str) -> None:
    rendezvous.join("gloo", rank, WORLD, port=port, timeout_s=60)
    try:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        with open(f"{out}/rank{rank}", "w") as f:
            f.write(str(total.item()))
    finally:
        dist.destroy_process_group()


def test_no_other_socket_can_take_the_port_once_it_is_chosen():
    store = rendezvous.serve(timeout_s=30)
    with socket.socket() as other, pytest.raises(OSError) as err:
        other.bind((rendezvous.LOCALHOST, store.port))
    assert err.value.errno == errno.EADDRINUSE


def test_the_backend_adds_gloo_for_host_memory_beside_nccl_only_with_cpu_offload():
    """Offloaded shards are reduced in host memory (the gradient norm, a gathered state),
    which NCCL cannot do; a CPU worker's gloo already can."""
    assert rendezvous.backend(False) == rendezvous.backend(False, cpu_offload=True) == "gloo"
    assert rendezvous.backend(True) == "nccl"
    assert rendezvous.backend(True, cpu_offload=True) == "cuda:nccl,cpu:gloo"


def test_ranks_in_other_processes_meet_through_the_served_store(tmp_path):
    store = rendezvous.serve(timeout_s=60)
    mp.spawn(_rank, args=(store.port, str(tmp_path)), nprocs=WORLD, join=True)
    sums = [float((tmp_path / f"rank{r}").read_text()) for r in range(WORLD)]
    assert sums == [3.0, 3.0]

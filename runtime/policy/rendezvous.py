"""Where the data-parallel ranks meet: a store whose port nobody else can take first.

The usual recipe, bind port 0, read the number, close the socket and let
``init_process_group(init_method="tcp://host:port")`` bind it again, leaves a window in which
any process on the node can take that port (another run, Ray, a gloo connection of a peer
group), and the start then fails with EADDRINUSE. Here the store that serves the rendezvous
binds port 0 itself and keeps listening; the number it got is what the other ranks are told,
so nothing can come between choosing the port and listening on it.

Whoever starts the ranks holds the `serve` store (rank 0 itself, or a parent process) and
keeps it alive while they run; every other rank `join`s it by host and port.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

LOCALHOST = "127.0.0.1"


def backend(gpu: bool, *, cpu_offload: bool = False) -> str:
    """The process group's backend: gloo on CPU, NCCL with a GPU; with a GPU and
    ``policy.dtensor_cfg.cpu_offload`` both, per device type, since the gradient norm and
    the gathered state then reduce tensors held in host memory."""
    if not gpu:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def serve(timeout_s: float = 300.0) -> dist.TCPStore:
    """A listening store on a port the kernel picks (``.port``); the ranks connect later."""
    return dist.TCPStore(
        LOCALHOST,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def join(
    backend: str,
    rank: int,
    world_size: int,
    *,
    port: int,
    host: str = LOCALHOST,
    timeout_s: float = 300.0,
    store: dist.Store | None = None,
) -> None:
    """``init_process_group`` through the store at ``host:port`` (or ``store``, when this
    process serves it); waits up to ``timeout_s`` for the store and for the other ranks."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )

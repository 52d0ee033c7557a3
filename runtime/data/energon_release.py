"""Shutting an energon loader down completely, so a rebuilt one (after each abort) leaks
nothing.

energon stops its worker processes and closes its tar files only when the garbage collector
gets to the loader, and its objects sit in reference cycles, so each rebuilt loader would
keep its processes, queues and shard handles until the next cyclic collection. These
functions reach into energon's and torch's loader attributes to release them at once; each
attribute is looked up defensively, since none of them is public API.
"""

from __future__ import annotations

from typing import Any


def release_energon_loader(loader: Any, iterator: Any) -> None:
    """Close `iterator` (the loader's, or None), stop the worker processes and their queues,
    and close every data set's tar readers."""
    if iterator is not None:
        iterator.close()
    if loader is None:
        return
    torch_iter = getattr(loader, "_iterator", None)
    if torch_iter is not None and hasattr(torch_iter, "_shutdown_workers"):
        torch_iter._shutdown_workers()
    loader._iterator = None
    epoch_iter = getattr(loader, "_epoch_iterator", None)
    if epoch_iter is not None:
        epoch_iter.close()
        loader._epoch_iterator = None
    for queue in [*getattr(loader, "cmd_queues", []), *getattr(loader, "result_queues", [])]:
        queue.close()
        queue.join_thread()
    close_tar_readers(loader.dataset)


def close_tar_readers(root: Any) -> None:
    """Close the tar/index file handles of every energon data set under `root`."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for reader in getattr(node, "join_readers", None) or ():
            reader.close()
            offsets = getattr(reader, "cached_offset_reader", None)
            cache = getattr(offsets, "tar_index_reader_cache", None) or {}
            for entry in cache.values():
                entry.tar_index_reader.close()
            cache.clear()
        stack.append(getattr(node, "dataset", None))
        for item in getattr(node, "datasets", None) or ():
            stack.append(item[0] if isinstance(item, tuple) else item)

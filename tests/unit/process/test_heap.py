"""The policy worker's heap (runtime/process/heap.py), measured in real processes: a block
freed by a thread other than the main one (where a Ray actor's methods run) comes back from
the heap, where glibc's defaults hand it to the kernel and fault in fresh pages again."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from sft_runtime.runtime.process.heap import WORKER_HEAP, worker_heap_env

ROUNDS = 32
BIG = 16 << 20  # floats: 64 MiB, over glibc's largest mmap threshold (32 MiB)
# in a thread of its own: rounds that allocate and touch a 64 MiB and a 16 MiB block and
# free them; the minor page faults of the rounds after 4 of warm-up (the first gets every
# page from the kernel, and the heap takes a few more, some runs more than others, to settle
# on a layout where both blocks come from what the last round freed)
PROGRAM = f"""
import resource, threading, torch
out = {{}}
def one_round():
    a = torch.empty({BIG}); a.fill_(1.0)
    b = torch.empty({BIG // 4}); b.fill_(2.0)
    del a, b
def work():
    for _ in range(4):
        one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({ROUNDS}):
        one_round()
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
t = threading.Thread(target=work); t.start(); t.join()
print(out["faults"])
"""
BIG_PAGES = BIG * 4 // os.sysconf("SC_PAGE_SIZE")
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _faults(env: dict[str, str]) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc variables")
def test_a_worker_heap_reuses_what_a_thread_frees_where_the_default_faults_it_in_again():
    default = _faults({})
    kept = _faults(dict(WORKER_HEAP))
    # the default maps the big block apart and unmaps it when freed: every round faults its
    # pages in again; the worker's heap serves it from what the last round freed
    assert default > ROUNDS * BIG_PAGES * 0.9, (default, BIG_PAGES)
    assert kept < default / 3, (kept, default)


def test_a_value_the_user_exported_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    env = worker_heap_env()
    assert "MALLOC_ARENA_MAX" not in env
    if GLIBC:  # the others are still handed on
        assert env == {k: v for k, v in WORKER_HEAP.items() if k != "MALLOC_ARENA_MAX"}
    else:
        assert env == {}

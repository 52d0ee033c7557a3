"""A temporary directory of its own for the processes a test starts, and what they left in it.

Libraries write to the temporary directory (``TMPDIR``) and count on their exit hooks to
clean up; a process that is killed rather than exited (a Ray actor) runs none. A test that
points its processes at a fresh directory sees every file they forgot.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def fresh_temp_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory right under the system's, short enough for Ray's socket paths;
    removed with whatever is in it at the end."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def left_behind(root: Path) -> list[str]:
    """What the processes left in ``root``. Ray's own root may stay, empty (other Rays on the
    machine may share it), and so may torch's per-user compile cache
    (``torchinductor_<user>``: one for every run of the user, not one per run)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p != root / "ray" and not p.relative_to(root).parts[0].startswith("torchinductor_")
    )

"""No progress bars from energon inside a training process.

energon draws a tqdm bar ("Filling reading buffer") whenever a packing loader fills its
buffer, in every worker and again on every loader rebuild (each abort rewinds by rebuilding),
and offers no setting to turn it off. In a run those bars are noise from processes the user
never looks at, interleaved by Ray into the run's output; the runtime's own progress display
lives in the driver. tqdm is already imported in a Ray worker (Ray imports it), so its
``TQDM_DISABLE`` variable, read at import, comes too late for this process: bars are switched
off by default here, and the variable is set for the energon worker processes it starts.
"""

from __future__ import annotations

import functools
import os

_done = False


def quiet_progress_bars() -> None:
    """Make tqdm bars of this process (and of processes it starts) disabled unless a caller
    asks for one explicitly with ``disable=False``. Safe to call more than once."""
    global _done
    if _done:
        return
    _done = True
    os.environ["TQDM_DISABLE"] = "1"
    try:
        import tqdm.std
    except ImportError:  # no tqdm, no bars
        return
    tqdm.std.tqdm.__init__ = functools.partialmethod(tqdm.std.tqdm.__init__, disable=True)

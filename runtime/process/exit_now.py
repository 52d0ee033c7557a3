"""The `sft-runtime` process ends as soon as its exit hooks have run.

After a command returns, a normal exit waits for the program's threads, runs the exit hooks
(Ray's shutdown, the removal of the embedded Ray's session folder, logging's flush), and
then frees every module and object the interpreter holds. With torch, transformers and Ray
loaded that last part takes about a second on a 2-core machine (measured on a toy
`sft-runtime train`: 1.1 s between the last exit hook and the process's end) and does
nothing a user can see. The console script owns its interpreter, so it skips that part; a
program that embeds the runtime calls `main` and keeps its own exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Run the exit hooks, flush the standard streams, and end the process with ``code``.

    A thread the normal exit would wait for (one that is not a daemon) keeps the normal exit:
    ending the process under it could lose what it is writing.
    """
    main = threading.main_thread()
    if any(t is not main and t.is_alive() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)

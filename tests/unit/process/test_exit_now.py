"""`exit_now` ends the process with the command's code once every exit hook has run, and
keeps the normal exit while a thread that exit would wait for is still working."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = textwrap.dedent(
        """
        import atexit, sys, threading
        from pathlib import Path
        from sft_runtime.runtime.process.exit_now import exit_now
        out = Path(sys.argv[1])
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("code", [0, 1, 2, 130])
def test_the_code_the_hooks_and_the_streams_all_come_out(tmp_path, code):
    done = _run(
        f"""
        atexit.register(lambda: out.write_text("hook ran"))
        print("unflushed line", end="")
        sys.stderr.write("unflushed error")
        exit_now({code})
        out.write_text("exit_now returned")
        """,
        tmp_path,
    )
    assert done.returncode == code, done.stderr
    assert (tmp_path / "out").read_text() == "hook ran"
    assert done.stdout == "unflushed line" and done.stderr == "unflushed error"


def test_a_working_thread_is_waited_for(tmp_path):
    # the thread waits until the normal exit is chosen, then writes: an exit that did not
    # wait for it would end the process before the file exists
    done = _run(
        """
        go = threading.Event()

        def work():
            go.wait()
            out.write_text("thread wrote")

        threading.Thread(target=work).start()
        atexit.register(lambda: out.write_text(out.read_text() + ", then the hook ran"))
        normal_exit = sys.exit

        def release_then_exit(code):
            go.set()
            normal_exit(code)

        sys.exit = release_then_exit
        exit_now(3)
        """,
        tmp_path,
    )
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "out").read_text() == "thread wrote, then the hook ran"

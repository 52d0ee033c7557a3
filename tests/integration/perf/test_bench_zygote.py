"""bench/zygote.py: a process the smoke run's server forks behaves as a fresh one would.

Each case starts a real server and checks what a caller of subprocess sees: streams and
pipes, the exit status, signals, a new session, passed descriptors, argv, ``__main__``, the
working folder and the environment; and that a request whose start-up variables differ
from the server's gets a fresh interpreter instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import zygote  # noqa: E402

REPORT = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv,
    "main": __name__,
    "cwd": os.getcwd(),
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "sid": os.getsid(0),
    "var": os.environ.get("ZYGOTE_TEST_VAR"),
    "path0": sys.path[0],
    "torch": "torch" in sys.modules,
}))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Path]:
    """A server, with only torch imported (the rest of PRELOAD changes nothing here)."""
    folder = tmp_path_factory.mktemp("zygote")
    preload, zygote.PRELOAD = zygote.PRELOAD, ["torch"]
    try:
        with zygote.serving(folder):
            yield folder
    finally:
        zygote.PRELOAD = preload


def _report(out: str) -> dict:
    import json

    return json.loads(out.strip().splitlines()[-1])


def test_a_script_runs_as_main_with_its_argv_folder_and_environment(server, tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    done = zygote.run(
        [sys.executable, str(script), "a", "b"],
        cwd=tmp_path,
        env={**os.environ, "ZYGOTE_TEST_VAR": "seen"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    got = _report(done.stdout)
    assert got["argv"] == [str(script), "a", "b"]
    assert got["main"] == "__main__"
    assert got["cwd"] == str(tmp_path)
    assert got["var"] == "seen"
    assert got["path0"] == str(tmp_path)
    assert got["torch"], "the process was not forked from the server (torch not imported)"
    assert got["ppid"] != os.getpid()  # the server's child, not this process's


def test_dash_c_exit_codes_and_stderr_come_back(server):
    done = zygote.run(
        [sys.executable, "-c", "import sys; print('to err', file=sys.stderr); sys.exit(7)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr.strip()) == (7, "to err")
    raised = zygote.run(
        [sys.executable, "-c", "raise ValueError('boom')"], capture_output=True, text=True
    )
    assert raised.returncode == 1 and "ValueError: boom" in raised.stderr


def test_a_pipe_conversation_a_kill_and_a_new_session(server):
    echo = "import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)\n"
    proc = zygote.Popen(
        [sys.executable, "-c", echo],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "HELLO"
    assert proc.poll() is None
    assert os.getsid(proc.pid) == proc.pid  # its own session: os.killpg reaches it
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_passed_descriptors_keep_their_numbers(server):
    read, write = os.pipe()
    proc = zygote.Popen(
        [sys.executable, "-c", f"import os; os.write({write}, b'through')"], pass_fds=(write,)
    )
    os.close(write)
    assert proc.wait(timeout=60) == 0
    assert os.read(read, 64) == b"through"
    os.close(read)


def test_a_console_script_of_this_interpreter_is_forked(server, tmp_path):
    script = tmp_path / "tool"
    script.write_text(f"#!{sys.executable}\n{REPORT}")
    script.chmod(0o755)
    done = zygote.run([str(script), "x"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = _report(done.stdout)
    assert got["argv"] == [str(script), "x"] and got["torch"]


def test_a_different_start_up_variable_or_a_python_option_starts_fresh(server, tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    env = {**os.environ, "MALLOC_ARENA_MAX": "1" + os.environ.get("MALLOC_ARENA_MAX", "7")}
    fresh = zygote.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert fresh.returncode == 0, fresh.stderr
    assert not _report(fresh.stdout)["torch"]
    assert _report(fresh.stdout)["ppid"] == os.getpid()
    option = zygote.run([sys.executable, "-S", str(script)], capture_output=True, text=True)
    assert not _report(option.stdout)["torch"]


def test_without_a_server_it_is_subprocess(tmp_path, monkeypatch):
    monkeypatch.delenv(zygote.ENV, raising=False)
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    done = zygote.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    got = _report(done.stdout)
    assert got["ppid"] == os.getpid() and not got["torch"]

"""Smoke mode's Python processes, forked from one that has imported the stack already.

A fresh interpreter that imports torch, transformers, Ray and energon costs about 3.5 core-s
here, and `run_all.py --smoke` starts about forty of them (each benchmark, its plain loops,
its `--child` sides, its `sft-runtime` launches), mostly to import the same modules. So in
smoke mode `run_all.py` starts this server once (`serving`), which imports `PRELOAD` and then
forks, on request, a process that runs a script as ``python SCRIPT ARGS`` would: the same
``sys.argv``, ``__main__``, working directory, environment, standard streams, session and
passed file descriptors. `Popen` and `run` take subprocess's arguments and ask the server
when there is one (``ENV`` names its socket), else start a fresh interpreter as subprocess
does, so `make bench` (full mode, no server) measures fresh processes, as users start them.

A forked process stands for a fresh one only where nothing read when a process starts
differs: a request whose environment changes the C library's or the interpreter's start-up
variables (`AT_EXEC`), or that runs Python with options, gets a fresh interpreter. After
its imports the server has one thread, so forking it is safe; it stays single-threaded (its
loop polls for requests and for children that ended).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import traceback
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ENV = "SFT_BENCH_ZYGOTE"  # the server's socket, for every process started under it
PRELOAD = [
    "torch",
    "transformers",
    "ray",
    "megatron.energon",
    "sft_runtime.runtime.launch.driver",
    "bench.harness",
]
# read when a process starts (the dynamic loader, malloc, OpenMP, the interpreter): a request
# that sets one of these differently from the server's own environment gets a fresh process
AT_EXEC = ("LD_", "MALLOC_", "GLIBC_TUNABLES", "PYTHON", "OMP_", "MKL_")
_POLL_S = 0.02
_SYS_PATH: list[str] = []  # the server's sys.path as the interpreter set it, less its folder
_MAX_REQUEST = 1 << 20  # bytes: argv and environment, one datagram


def _may_fork(argv: Sequence[str]) -> bool:
    """Whether ``argv`` may be forked by the server rather than started fresh: a script (or
    ``-c``) run by this interpreter without options, or a console script of it."""
    if os.environ.get(ENV) is None or not argv:
        return False
    if argv[0] == sys.executable:
        return len(argv) > 1 and (argv[1] == "-c" or not argv[1].startswith("-"))
    return _is_python_script(argv[0])


def _is_python_script(path: str) -> bool:
    """A console script of this interpreter (``sft-runtime``): its first line names it."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline()
    except OSError:
        return False
    if not first.startswith(b"#!"):
        return False
    return os.path.realpath(os.fsdecode(first[2:].strip())) == os.path.realpath(sys.executable)


class Popen(subprocess.Popen):
    """subprocess.Popen, whose process the server forks when there is one (see the module);
    pipes, communicate, signals and the exit status work as they do for a fresh process."""

    def __init__(self, args: Sequence[str], **kwargs: Any) -> None:
        # a command line for a shell, or another executable than argv's first: subprocess's
        plain = isinstance(args, str | bytes) or kwargs.get("shell") or kwargs.get("executable")
        argv = args if plain else [os.fspath(a) for a in args]
        self._may_fork = not plain and _may_fork(argv)
        self._session = bool(kwargs.get("start_new_session"))
        self._status: socket.socket | None = None  # where the server sends the exit status
        super().__init__(argv, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):  # type: ignore[override]
        # rest: startupinfo, creationflags, shell, the six pipe ends, then the POSIX options
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = rest[3:9]
        if self._may_fork:
            # -1: the stream this process has, as a fresh child would inherit it
            streams = [fd if fd != -1 else i for i, fd in enumerate((p2cread, c2pwrite, errwrite))]
            self._status = _ask(args, cwd, env, self._session, streams, list(pass_fds))
        if self._status is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest
            )
        self.pid = int(self._status.recv(64))
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._status is None:
            return super()._try_wait(wait_flags)
        if wait_flags & os.WNOHANG and not select.select([self._status], [], [], 0)[0]:
            return (0, 0)
        reply = self._status.recv(64)
        self._status.close()
        self._status = None
        # the server sends every status; nothing means it died: count the process as killed
        return (self.pid, int(reply) if reply else signal.SIGKILL)

    def _internal_poll(self, _deadstate=None, **_: Any):  # type: ignore[override]
        if self._status is None:
            return (
                super()._internal_poll(_deadstate) if self.returncode is None else self.returncode
            )
        pid, sts = self._try_wait(os.WNOHANG)
        if pid == self.pid:
            self._handle_exitstatus(sts)
        return self.returncode


def _ask(
    argv: list[str],
    cwd: Any,
    env: Any,
    session: bool,
    streams: list[int],
    pass_fds: list[int],
) -> socket.socket | None:
    """The server's connection once it forked the process (the pid comes next, then the
    exit status), or None where it must start fresh (`AT_EXEC`)."""
    env = os.environ if env is None else env
    request = {
        "argv": argv,
        "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
        "env": {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
        "session": session,
        "pass_fds": pass_fds,
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(os.environ[ENV])
        socket.send_fds(conn, [json.dumps(request).encode()], [*streams, *pass_fds])
        if conn.recv(64) == b"fork":
            return conn
    except BaseException:
        conn.close()
        raise
    conn.close()
    return None


def run(args: Sequence[str], *, timeout: float | None = None, check: bool = False, **kwargs):
    """subprocess.run through `Popen`."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        except BaseException:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[None]:
    """The server, its socket in ``folder``, named in this process's environment (so in
    every process started under it) until the block ends."""
    path = str(folder / "zygote.sock")
    server = subprocess.Popen([sys.executable, __file__, path], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the zygote did not start (exit {server.wait()})")
        os.environ[ENV] = path
        yield
    finally:
        os.environ.pop(ENV, None)
        server.terminate()
        server.wait()


def serve(path: str) -> None:
    """Import `PRELOAD`, then fork a process for each request until the parent is gone."""
    global _SYS_PATH
    _SYS_PATH = sys.path[1:]  # a script's process has its folder in front of these
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `tests`
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    waiting: dict[int, socket.socket] = {}  # pid -> the connection its status goes back on
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    while os.getppid() == parent:
        if select.select([listener], [], [], _POLL_S)[0]:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 64)
            request = json.loads(message)
            if _set_at_exec(request["env"]) != _set_at_exec(os.environ):
                conn.send(b"fresh")
                conn.close()
            else:
                conn.send(b"fork")
                waiting[_fork(request, fds, conn, listener, waiting)] = conn
            for fd in fds:
                os.close(fd)
        while waiting:
            pid, sts = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(str(sts).encode())
                conn.close()


def _set_at_exec(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(AT_EXEC)}


def _fork(
    request: dict, fds: list[int], conn: socket.socket, listener: socket.socket, waiting: dict
) -> int:
    """The pid of the process forked for ``request``, sent on ``conn`` too."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in (conn, *waiting.values()):
            other.close()
        _become(request, fds)
    conn.send(str(pid).encode())
    return pid


def _become(request: dict, fds: list[int]) -> None:
    """In the forked process: take the request's streams, descriptors, folder, environment
    and argv, run its script as ``__main__``, and exit as the interpreter would."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if request["session"]:
        os.setsid()
    # out of the way of the numbers they go to, then onto them
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, [0, 1, 2, *request["pass_fds"]], strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    code: Any = 0
    try:
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        if argv[0] == sys.executable and argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            sys.path[:] = ["", *_SYS_PATH]
            exec(compile(argv[2], "<string>", "exec"), main.__dict__)
        else:
            at = 1 if argv[0] == sys.executable else 0  # python SCRIPT ..., or SCRIPT ...
            sys.argv = argv[at:]
            sys.path[:] = [str(Path(argv[at]).resolve().parent), *_SYS_PATH]
            runpy.run_path(argv[at], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr, flush=True)
            code = 1
        os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])

"""A warm start: ``hp run`` agents, and Python programs, forked from one process that has already imported torch.

Why: an agent imports torch, its distributed and optimizer packages and ``torch._dynamo`` before it forks
its node's fork server (:mod:`hp.core.fork_context`), and pays the interpreter's teardown of them at exit:
~3.5 CPU s on the 2-core box, most of what a short job costs. A machine that starts many short jobs (a test
session: ~270 agents, ~1,000 of its ~2,800 CPU s) pays it each time.

How: a warm-start server (``python -m hp.core.warm_server SOCKET``) imports once what an agent imports,
freezes it (:func:`gc.freeze`) and listens on a Unix socket in a private directory. When ``HP_WARM_START``
names that socket, ``hp run`` (the *stand-in*) asks the server to fork the agent instead of running it
itself (so do ``hp demo``, ``hp bench`` and ``hp chaos``, which import torch too: :data:`WARM_COMMANDS`). The fork becomes the process the stand-in would have been: its standard streams (passed over the
socket), working directory, environment (also what ``/proc/<pid>/environ`` shows), umask, CPU affinity,
niceness and network namespace (``nsenter --net``), with the stand-in's command line as its title. The
stand-in stays the process its caller knows:

* a signal it can catch (TERM, INT, HUP, QUIT, USR1, USR2, CONT) is passed on to the agent;
* it exits as the agent did (same code, or killed by the same signal);
* killed itself (SIGKILL: a timeout, a test tearing down its process group), the agent is killed at once:
  the kernel sends the agent SIGKILL when the stand-in's end of the socket closes (``F_SETSIG``).

:func:`resolve` maps a stand-in's pid to its agent's, for whoever signals "the agent" with what it cannot
pass on (SIGSTOP) or reads its children. What stays different: the agent's parent is the server, and a
SIGSTOP to the stand-in stops only the stand-in. Under a scheduler (``SLURM_JOB_ID``) the stand-in never
asks: the step's processes must stay the step's.

Requests cross the socket as one JSON line (never a pickle) from a process of the server's own user
(``SO_PEERCRED``) and of the same interpreter and hp installation; anything else is refused and the
stand-in runs the agent itself.

The same for any Python program of this interpreter: ``python -m hp.core.warm_start SCRIPT ARGS`` (or ``-m
MODULE ARGS``, ``-c CODE ARGS``; :func:`python_command` builds it, or the plain command without a server) is the stand-in of
``python SCRIPT ARGS``. The fork runs it as that interpreter would (``__main__``, ``sys.argv``, the script's
directory first on ``sys.path``: :func:`hp.core.worker_main.exec_main`), with torch's thread count from the
fork's own ``OMP_NUM_THREADS`` (torch's OpenMP read the server's at its import). A process of many short
programs that import torch (a test session's worker processes) pays each import once.

The server needs ``CAP_SYS_RESOURCE`` or ``CAP_CHECKPOINT_RESTORE``
(``prctl(PR_SET_MM)``) to show a fork's environment; without either it refuses to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hp.core.protocol import WARM_START_ENV

MAX_REQUEST = 4 << 20  # bytes: argv and environment
REQUEST_WAIT_S = 5.0  # a connected stand-in sends its request at once
REPLY_WAIT_S = 30.0  # the server forks at once (a busy 2-core box: well under a second); past it, run cold
# a server still importing (it listens once ready): waited for while it lives, as a cold start would import
# the same beside it (5 cold ranks and the server on 2 cores: 76 s for what takes 2 s warm)
STARTUP_WAIT_S = 120.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)
TITLE_ROOM = 4096  # bytes of command line the server keeps for its forks' titles (setproctitle writes there)
_IN_SERVER = False  # set in the server, so in its forks: a fork runs the agent itself (set_in_server)


def set_in_server(value: bool) -> None:
    """Whether this process is the warm-start server (or a fork of it that must not ask it again)."""
    global _IN_SERVER
    _IN_SERVER = value


# ---- the stand-in ----------------------------------------------------------------------------
WARM_COMMANDS = ("run", "demo", "bench", "chaos")  # `hp controller` stays cold: tests and `hp bench failover`
# SIGSTOP it by its pid


def _is_warm(argv: list[str]) -> bool:
    rest = list(argv)
    while rest and rest[0].startswith("--log-level"):
        rest = rest[1:] if "=" in rest[0] else rest[2:]
    return bool(rest) and rest[0] in WARM_COMMANDS


def identity() -> dict[str, str]:
    import hp.core

    return {"executable": sys.executable, "hp": os.path.dirname(os.path.abspath(hp.core.__file__))}


def _server() -> str:
    """The warm-start server's socket this process may ask ("": none, or this process must run cold)."""
    path = os.environ.get(WARM_START_ENV, "")
    return "" if _IN_SERVER or os.environ.get("SLURM_JOB_ID") else path


def delegate(argv: list[str], mode: str = "hp") -> int | None:
    """In ``hp`` (``mode`` "hp"), or the stand-in of a Python program (``mode`` "python", ``argv`` what
    follows the interpreter): have the warm-start server named by ``HP_WARM_START`` run it and wait for it as
    that process itself (see the module docstring). None: no server, another command, or refused: run here."""
    path = _server()
    if not path or (mode == "hp" and not _is_warm(argv)):
        return None
    # held from the request until they can be passed on: one sent meanwhile is the agent's, not a kill
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        return _delegate(path, argv, mode)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)


def program(args: list[str]) -> bool:
    """Whether ``args`` (what follows the interpreter) name a program a fork can run: SCRIPT, -m MODULE or
    -c CODE, then its arguments (other interpreter options run cold)."""
    return bool(args) and (not args[0].startswith("-") or (args[0] in ("-m", "-c") and len(args) > 1))


def python_command(args: list[str]) -> list[str]:
    """The command line that runs ``python ARGS`` (``SCRIPT ...`` or ``-m MODULE ...``) with this interpreter:
    forked by this process's warm-start server when it has one (a stand-in in front), else plainly."""
    if not program(args) or not _server():
        return [sys.executable, *args]
    return [sys.executable, "-m", "hp.core.warm_start", *args]


def main(args: list[str]) -> int:
    """``python -m hp.core.warm_start ARGS``: the stand-in of ``python ARGS``; without a server (or refused),
    the interpreter is exec'd on ``ARGS`` (the same process, cold)."""
    code = delegate(args, "python") if program(args) else None
    if code is None:
        os.execv(sys.executable, [sys.executable, *args])
    return code


def _await_server(path: str) -> None:
    """Wait while the session's server (its pid in ``server`` beside the socket) is alive and not yet listening."""
    from hp.core.worker_signals import pid_alive

    try:
        server = int((Path(path).parent / "server").read_text())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + STARTUP_WAIT_S
    while not os.path.exists(path) and pid_alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)


def _delegate(path: str, argv: list[str], mode: str) -> int | None:
    _await_server(path)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(REQUEST_WAIT_S)
        conn.connect(path)
        fds = [fd for fd in (0, 1, 2) if _valid_fd(fd)]
        umask = os.umask(0)
        os.umask(umask)
        # the title: the command line the process would have had (a program's: `python ARGS`)
        title = [sys.executable, *(sys.orig_argv[1:] if mode == "hp" else argv)]
        request = {**identity(), "mode": mode, "argv": [sys.argv[0], *argv] if mode == "hp" else list(argv),
                   "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
                   "affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                   "fds": fds, "title": " ".join(title)}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        conn.settimeout(REPLY_WAIT_S)
        reader = conn.makefile("rb")
        reply = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        conn.close()
        return None
    pid = reply.get("pid")
    if not isinstance(pid, int):
        conn.close()
        return None
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _pass_on(pid, signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    conn.settimeout(None)
    try:
        end = json.loads(reader.readline() or b"{}")
    except ValueError:
        end = {}
    if "signal" in end:
        sig = int(end["signal"])
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        time.sleep(1)
    if "exit" not in end:
        print("hp: the warm-start server ended before the agent reported how it ended", file=sys.stderr)
        return 1
    return int(end["exit"])


def _valid_fd(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _pass_on(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def resolve(pid: int) -> int:
    """The agent a stand-in ``pid`` waits for (``pid`` itself when it is none)."""
    path = os.environ.get(WARM_START_ENV, "")
    if not path:
        return pid
    try:
        return int((Path(path).parent / "pids" / str(pid)).read_text())
    except (OSError, ValueError):
        return pid


@contextlib.contextmanager
def session() -> Iterator[str]:
    """A warm-start server for this process and everything it starts: ``HP_WARM_START`` is set while the
    context lasts; yields the socket. This process does not wait for it; a stand-in waits while it imports
    (seconds), and runs cold if it cannot start."""
    root = tempfile.mkdtemp(prefix="hp-warm-")  # 0700, ours
    (Path(root) / "pids").mkdir(mode=0o700)
    path = os.path.join(root, "sock")
    room = "x" * TITLE_ROOM
    proc = subprocess.Popen([sys.executable, "-m", "hp.core.warm_server", path, room], stdin=subprocess.DEVNULL)
    (Path(root) / "server").write_text(str(proc.pid))  # a stand-in waits for it while it starts
    old = os.environ.get(WARM_START_ENV)
    os.environ[WARM_START_ENV] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop(WARM_START_ENV, None)
        else:
            os.environ[WARM_START_ENV] = old
        proc.kill()
        proc.wait()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # the stand-in of `python ARGS` (the module's flags live in the imported copy)
    from hp.core import warm_start

    sys.exit(warm_start.main(sys.argv[1:]))

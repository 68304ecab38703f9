"""The warm-start server (:mod:`hp.core.warm_start`): it imports what an agent imports, then forks, for
each stand-in's request, a process that becomes the one the stand-in would have been and runs ``hp`` or
the Python program the stand-in stands for.

``python -m hp.core.warm_server SOCKET [ROOM]``: ROOM is command-line space for the forks' titles
(setproctitle writes within the server's own command line). Dies with its parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
from pathlib import Path

from hp.core import warm_start
from hp.core.warm_start import FORWARDED, MAX_REQUEST, REQUEST_WAIT_S, identity

_PR_SET_MM, _PR_SET_MM_MAP = 35, 14
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)
_CLONE_NEWNET = 0x40000000
_ENV_KEEP: list = []  # the buffer a fork's /proc/<pid>/environ points at
# read once, when an interpreter starts: a request whose values differ from the server's is refused (the
# stand-in runs cold); PYTHONPATH is applied in the fork, PYTHONUNBUFFERED to its streams
INTERPRETER_ENV = ("PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS",
                   "PYTHONFAULTHANDLER", "PYTHONDEVMODE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONNOUSERSITE",
                   "PYTHONSAFEPATH", "PYTHONHOME", "PYTHONINTMAXSTRDIGITS", "PYTHONMALLOC", "PYTHONTRACEMALLOC",
                   "PYTHONSTARTUP", "PYTHONPLATLIBDIR", "PYTHONUSERBASE")


def preload() -> None:
    """Import what an agent imports (and its fork server preloads), and build the ``hp`` parser once: every
    plugin's commands are imported."""
    from hp.core import agent, cli, commands, fork_context  # noqa: F401

    fork_context.import_preloaded()
    cli.build_parser()


class _MmMap(ctypes.Structure):  # <linux/prctl.h> struct prctl_mm_map
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
        "arg_start", "arg_end", "env_start", "env_end", "auxv")] + [("auxv_size", ctypes.c_uint32),
                                                                   ("exe_fd", ctypes.c_uint32)]


def _set_environ_area(env: dict[str, str]) -> None:
    """Point this process's ``/proc/<pid>/environ`` at ``env``: the kernel shows the area the process was
    started with, which ``os.environ`` never changes. ``prctl(PR_SET_MM, PR_SET_MM_MAP)`` (CAP_SYS_RESOURCE
    or CAP_CHECKPOINT_RESTORE) with every other bound as it is."""
    data = b"".join(f"{k}={v}".encode(errors="surrogateescape") + b"\0" for k, v in env.items()) or b"\0"
    buf = ctypes.create_string_buffer(data, len(data))
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/stat", "rb") as f:
        fields = [int(x) for x in f.read().rpartition(b")")[2].split()[1:]]
    field = lambda n: fields[n - 4]  # noqa: E731  proc(5)'s numbering: field 4 is the first after the state
    libc.sbrk.restype = ctypes.c_void_p
    mm = _MmMap(start_code=field(26), end_code=field(27), start_data=field(45), end_data=field(46),
                start_brk=field(47), brk=libc.sbrk(0), start_stack=field(28), arg_start=field(48),
                arg_end=field(49), env_start=ctypes.addressof(buf), env_end=ctypes.addressof(buf) + len(data),
                auxv=0, auxv_size=0, exe_fd=0xFFFFFFFF)
    if libc.prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_MM_MAP): {os.strerror(ctypes.get_errno())}")
    _ENV_KEEP[:] = [buf]


def _enter_netns(pid: int) -> None:
    mine, theirs = os.stat("/proc/self/ns/net").st_ino, os.stat(f"/proc/{pid}/ns/net").st_ino
    if mine == theirs:
        return
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET)")
    finally:
        os.close(fd)


def _become(conn: socket.socket, request: dict, fds: list[int], peer: int) -> None:
    """In the fork: become the process the stand-in ``peer`` would have been, then run ``hp``."""
    for sig in (*FORWARDED, signal.SIGCHLD):  # as a new interpreter has them (SIGPIPE stays ignored)
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # killed with the stand-in: its end of the socket closing sends this process SIGKILL
    fcntl.fcntl(conn.fileno(), fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(conn.fileno(), _F_SETSIG, signal.SIGKILL)
    fcntl.fcntl(conn.fileno(), fcntl.F_SETFL, fcntl.fcntl(conn.fileno(), fcntl.F_GETFL) | os.O_ASYNC)
    if select.select([conn], [], [], 0)[0]:  # it closed before the line above: nothing would signal it
        os._exit(128 + signal.SIGKILL)
    os.setsid()
    for target, fd in zip(request["fds"], fds):
        os.dup2(fd, target)
        os.close(fd)
    for target in {0, 1, 2} - set(request["fds"]):
        os.close(target)
    _enter_netns(peer)
    os.sched_setaffinity(0, request["affinity"])
    os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    from hp.core.worker_signals import set_title

    set_title(request["title"])  # first: setproctitle finds the command line's memory through environ[0]
    os.environ.clear()
    os.environ.update(request["env"])
    _set_environ_area(request["env"])
    import multiprocessing

    multiprocessing.current_process().authkey = os.urandom(32)  # not the server's, shared by every fork
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False) if 0 in request["fds"] else None  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1 if unbuffered or os.isatty(1) else -1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = request["argv"]
    _set_threads(request["env"])


_DEFAULT_THREADS: list[int] = []  # torch's intra-op threads in the server, started without OMP_NUM_THREADS


def _set_threads(env: dict[str, str]) -> None:
    """torch's intra-op thread count as a cold start under ``env`` would have it: OpenMP read the server's
    environment when torch was imported."""
    import torch

    wanted = env.get("OMP_NUM_THREADS", "")
    n = int(wanted) if wanted.isdigit() and int(wanted) > 0 else _DEFAULT_THREADS[0]
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _main(request: dict):
    """What the fork runs: ``hp``'s main, or the program a ``python`` stand-in stands for."""
    if request["mode"] == "hp":
        from hp.core import cli

        return cli.main
    from hp.core.worker_main import exec_main

    warm_start.set_in_server(False)  # a program may start warm programs of its own
    if request["argv"][0] == "-m":
        sys.path[0] = os.getcwd()  # as `python -m` has it (a script's directory: exec_main)
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra  # where the interpreter puts PYTHONPATH: after sys.path[0]
    return lambda: exec_main(request["argv"])


def _run(main) -> int:
    """``main`` as the interpreter would run it, ending as it would: non-daemon threads joined, atexit
    handlers run, streams flushed; the teardown of the preloaded modules is skipped."""
    import atexit
    import threading
    import traceback

    code, interrupted = 1, False
    try:
        code = main()
        code = 0 if code is None else code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else (print(e.code, file=sys.stderr) or 1))
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001  as the interpreter: the traceback, exit 1
        traceback.print_exc()
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


_FIELDS = {"executable": str, "hp": str, "mode": str, "argv": list, "env": dict, "cwd": str, "umask": int,
           "affinity": list, "nice": int, "fds": list, "title": str}


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(REQUEST_WAIT_S)
    data, fds = b"", []
    try:
        while not data.endswith(b"\n"):
            chunk, got, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
            fds += got
            if not chunk or len(data) + len(chunk) > MAX_REQUEST:
                raise ValueError("request cut short or too large")
            data += chunk
        return _parsed(data, fds), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _parsed(data: bytes, fds: list[int]) -> dict:
    request = json.loads(data)
    if not isinstance(request, dict) or any(not isinstance(request.get(k), t) for k, t in _FIELDS.items()) or \
            request["mode"] not in ("hp", "python") or not all(isinstance(a, str) for a in request["argv"]) or \
            (request["mode"] == "python" and not warm_start.program(request["argv"])) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in request["env"].items()) or \
            not request["affinity"] or not all(isinstance(c, int) for c in request["affinity"]) or \
            len(fds) != len(request["fds"]) or not set(request["fds"]) <= {0, 1, 2}:
        raise ValueError("malformed request")
    return request


class _Server:
    def __init__(self, path: str) -> None:
        self.path, self.identity = path, identity()
        self.interpreter_env = {k: os.environ.get(k) for k in INTERPRETER_ENV}
        self.pids = Path(path).parent / "pids"
        self.children: dict[int, tuple[socket.socket, int]] = {}  # agent pid -> (its stand-in's socket, stand-in pid)

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path + ".new")
        os.chmod(self.path + ".new", 0o600)
        listener.listen(64)
        os.rename(self.path + ".new", self.path)  # the socket appears listening: a stand-in waits until it does
        while True:
            ready = select.select([listener, wake_r], [], [])[0]
            if wake_r in ready:
                os.read(wake_r, 4096)
                self._reap()
            if listener in ready:
                conn, _ = listener.accept()
                try:
                    self._fork(conn, listener, wake_r, wake_w)
                except OSError:  # the stand-in went away mid-request: it runs cold, or not at all
                    conn.close()

    def _fork(self, conn: socket.socket, listener: socket.socket, *pipe: int) -> None:
        pid_, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        try:
            if uid != os.getuid():
                raise ValueError("another user")
            request, fds = _read_request(conn)
            refusal = self._refusal(request)
            if refusal:
                for fd in fds:
                    os.close(fd)
                raise ValueError(refusal)
        except (OSError, ValueError) as e:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"refused": str(e)}).encode() + b"\n")
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                listener.close()
                for fd in pipe:
                    os.close(fd)
                for other, _stand_in in self.children.values():
                    other.close()
                _become(conn, request, fds, pid_)
                code = _run(_main(request))
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        (self.pids / str(pid_)).write_text(str(child))
        self.children[child] = (conn, pid_)
        with contextlib.suppress(OSError):
            conn.settimeout(REQUEST_WAIT_S)
            conn.sendall(json.dumps({"pid": child}).encode() + b"\n")

    def _refusal(self, request: dict) -> str:
        """Why the fork would not be the process the stand-in's would have been ("": it would)."""
        if {k: request[k] for k in self.identity} != self.identity:
            return "another interpreter or hp installation"
        differ = sorted(k for k, v in self.interpreter_env.items() if request["env"].get(k) != v)
        return f"interpreter settings differ: {', '.join(differ)}" if differ else ""

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn, stand_in = self.children.pop(pid, (None, None))
            if conn is None:
                continue
            end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(end).encode() + b"\n")
            conn.close()
            with contextlib.suppress(OSError):
                (self.pids / str(stand_in)).unlink()


def serve(path: str) -> None:
    """Preload, then fork agents for stand-ins until killed. Dies with its parent."""
    from hp.core.worker_signals import parent_death_signal

    parent = os.getppid()
    parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        return
    _set_environ_area(dict(os.environ))  # fails here, before anything is served, without CAP_SYS_RESOURCE or CAP_CHECKPOINT_RESTORE
    warm_start.set_in_server(True)  # its forks run hp themselves
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # torch's default thread count; each fork sets its own
        os.environ.pop(name, None)
    preload()
    import torch

    _DEFAULT_THREADS.append(torch.get_num_threads())
    gc.freeze()
    _Server(path).serve()


if __name__ == "__main__":  # the module hp imports must be the one that knows it is the server
    import hp.core.warm_server

    hp.core.warm_server.serve(sys.argv[1])

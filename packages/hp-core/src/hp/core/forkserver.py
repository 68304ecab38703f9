"""Workers forked from a pre-imported process instead of started as new interpreters.

Why: a worker started cold pays ``import torch`` and, at its first optimizer, ``torch._dynamo``: ~6 CPU s
measured on the 2-core box, and ~1.5 CPU s more for the interpreter's teardown of all those modules at
exit. A node's ranks and spares all pay it at once, and a replacement pays it while the ranks it will join
keep every core busy (at one fault per 30 s, ~8 % of the machine: more than the whole goodput budget).
The standard library's ``multiprocessing`` forkserver, preloaded once per node with those modules
(:mod:`hp.core.fork_context`: forked from the agent once it has imported them, or a new interpreter),
forks a child that already has them; each worker then pays only its script's own start (model, data).
``hp bench start`` measures a node's start and end either way. A forked worker dies with the server, and
the server with its agent, unless the worker runs hp's runtime (:mod:`hp.core.worker_signals`).

``hp run --start-method forkserver`` (the default) starts every worker and spare this way;
``--start-method spawn`` starts the first ones with torch elastic (:mod:`hp.core.workers`), as torchrun
does, and only replacement spares are forked. A forked worker is a :class:`~hp.core.workers.Worker` with
another way to start and to watch the process, and the same logs: with ``--tee`` a stream goes to
``<log_dir>/<name>/attempt_<k>/`` and is copied to the agent's console with the ``[name]:`` prefix
(elastic's ``TailLog``), without it the stream is the agent's own, as elastic does.

A forked worker ends as a multiprocessing child: after the script, its ``atexit`` handlers run and its
standard streams are flushed, then the process exits without the interpreter's teardown (objects still
alive are not finalized: a file the script left open and unflushed loses its buffer, as in any
multiprocessing child).

The request to the fork server (the worker's command and environment) crosses a local Unix socket
between the agent and its own child, authenticated by multiprocessing's per-process key; nothing
from the network is unpickled.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from hp.core import worker_main
from hp.core.fork_context import context as _context
from hp.core.worker_signals import parent_death_signal, set_title
from hp.core.workers import ExitStatus, Worker, exit_status


def _let_the_server_go() -> None:
    """Close this child's copy of the agent's end of the server's lifeline pipe. multiprocessing hands it to
    every forked child, so the server outlives its agent while any child lives. Without it the server ends
    with the agent, and the worker, re-parented, sees its agent gone (the orphan watch of hp.checkpointless
    reads the parent pid) instead of training on under a server that outlived it. A script's own
    forkserver context then starts a server of its own, as in any process."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _run(command: list[str], env: dict[str, str], stdout: str, stderr: str, name: str = "worker") -> None:
    """In the forked child: become the worker ``command`` would have started. An empty log path keeps
    the stream the server inherited from the agent."""
    set_title(f"hp {name}: {' '.join(command)}")  # ps would show the server's otherwise
    os.setsid()  # a session of its own, as elastic gives its workers: signals to the agent's group miss it
    server = os.getppid()
    parent_death_signal(signal.SIGKILL)  # with the server, so with the agent (hp's runtime clears it)
    if os.getppid() != server:
        os._exit(1)
    _let_the_server_go()
    # multiprocessing set this child's start method to the server's (forkserver): a script's DataLoader
    # workers would then be forked by a server of their own that re-runs the script to find its __main__
    multiprocessing.set_start_method(None, force=True)  # unset, as in a new interpreter
    for fd, path in ((1, stdout), (2, stderr)):
        if path:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  line-buffered, like python -u
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # the server's value is fixed; the worker's is what counts
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # as a new process has it (fork_preload)
    args = command[1:]
    while args and args[0] == "-u":
        args = args[1:]
    try:
        if args[:2] == ["-m", worker_main.__name__]:  # python_command's: leave SIGTERM to the agent, run the script
            worker_main.main(args[2:])
        else:
            worker_main.exec_main(args)
    finally:
        atexit._run_exitfuncs()  # what the interpreter's exit would run; multiprocessing's children skip it


@dataclass
class ForkedWorker(Worker):
    """A worker forked from the fork server (see the module docstring)."""

    _proc: Any = field(default=None, repr=False)
    _error_file: str = ""
    _tails: list[TailLog] = field(default_factory=list, repr=False)

    def start(self, env: dict[str, str]) -> None:
        d = os.path.join(self.log_dir, self.name, f"attempt_{self.restarts}")
        os.makedirs(d, exist_ok=True)
        self._error_file = os.path.join(d, "error.json")
        env = {**os.environ, **env, "TORCHELASTIC_RESTART_COUNT": str(self.restarts),
               "TORCHELASTIC_ERROR_FILE": self._error_file}
        tee = Std(self.tee) if not isinstance(self.tee, dict) else Std.NONE
        out = os.path.join(d, "stdout.log") if tee & Std.OUT else ""
        err = os.path.join(d, "stderr.log") if tee & Std.ERR else ""
        self.exit = None
        self._proc = _context().Process(target=_run, args=(self.command, env, out, err, self.name), name=self.name, daemon=False)
        self._proc.start()
        self.pid = self._proc.pid
        prefix = {0: f"[{self.name}]:"}  # elastic's tee: the file, copied to the agent's console
        self._tails = [TailLog(self.name, {0: path}, dst, prefix).start()
                       for path, dst in ((out, sys.stdout), (err, sys.stderr)) if path]

    @property
    def running(self) -> bool:
        return self._proc is not None and self.exit is None

    def poll(self) -> ExitStatus | None:
        if not self.running:
            return self.exit
        rc = self._proc.exitcode
        if rc is None:
            return None
        self.exit = exit_status(self.pid, rc, self._error_file)
        return self.exit

    def finish(self) -> None:
        if self._proc is not None and self._proc.exitcode is not None:
            self._proc.close()
            self._proc = None
            self._stop_tails()

    def _stop_tails(self) -> None:
        for tail in self._tails:
            tail.stop()  # after the last lines were copied
        self._tails = []

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self._proc is not None and self._proc.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
            else:
                self._proc.join(timeout_s)
                if self._proc.exitcode is None:
                    self._proc.kill()
                    self._proc.join()
        self._stop_tails()

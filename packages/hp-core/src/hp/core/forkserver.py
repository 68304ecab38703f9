"""Replacement hot spares forked from a pre-imported process instead of started as new interpreters.

Why: a spare started cold pays ``import torch`` and, at its first optimizer, ``torch._dynamo``:
~5 CPU s measured on the 2-core box, spent while the ranks it will join keep every core busy. At one
fault per 30 s that is ~8 % of the machine, more than the whole goodput budget. The standard
library's ``multiprocessing`` forkserver, preloaded with those modules once at job start, forks a
child that already has them; the spare then pays only its script's own start (model, data).

Only replacement spares (``hp run --replenish-spares``) come from here. The first workers and spares
are started by torch elastic (:mod:`hp.core.workers`): their start is not on the clock of a running
job. A forked worker is a :class:`~hp.core.workers.Worker` with another way to start and to watch
the process; its output goes to the same log files (not teed to the agent's console).

The request to the fork server (the worker's command and environment) crosses a local Unix socket
between the agent and its own child, authenticated by multiprocessing's per-process key; nothing
from the network is unpickled.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import patch

from hp.core.worker_main import exec_main
from hp.core.workers import ExitStatus, Worker, exit_status

# torch._dynamo is what the first optimizer step imports: ~2 of a spare's ~5 CPU s
PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo"]


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm(env: dict[str, str]) -> None:
    """Start the fork server and its imports now, at job start, rather than on the first replacement.

    ``env`` is what the workers get on top of the agent's environment. The server is started with
    it because some of it is read once, at import: OpenMP sizes its thread pool from
    ``OMP_NUM_THREADS`` when torch loads it, so a server started without the workers' ``1`` would
    fork spares that each run as many threads as the host has cores (measured: every step of the
    job slowed 4x once such a spare held a rank)."""
    from multiprocessing import forkserver

    _context()
    with patch.dict(os.environ, env):  # the server inherits the workers' environment, this process keeps its own
        forkserver.ensure_running()


def _run(command: list[str], env: dict[str, str], stdout: str, stderr: str) -> None:
    """In the forked child: become the worker ``command`` would have started."""
    os.setsid()  # a session of its own, as elastic gives its workers: signals to the agent's group miss it
    for fd, path in ((1, stdout), (2, stderr)):
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
    args = command[1:]
    while args and args[0] == "-u":
        args = args[1:]
    exec_main(args)  # python_command's: hp.core.worker_main, which runs the script


@dataclass
class ForkedWorker(Worker):
    """A worker forked from the fork server (see the module docstring)."""

    _proc: Any = field(default=None, repr=False)
    _error_file: str = ""

    def start(self, env: dict[str, str]) -> None:
        d = os.path.join(self.log_dir, self.name, f"attempt_{self.restarts}")
        os.makedirs(d, exist_ok=True)
        self._error_file = os.path.join(d, "error.json")
        env = {**os.environ, **env, "TORCHELASTIC_RESTART_COUNT": str(self.restarts),
               "TORCHELASTIC_ERROR_FILE": self._error_file}
        self.exit = None
        self._proc = _context().Process(
            target=_run, args=(self.command, env, os.path.join(d, "stdout.log"), os.path.join(d, "stderr.log")),
            name=self.name, daemon=False)
        self._proc.start()
        self.pid = self._proc.pid

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

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self._proc is None or self._proc.exitcode is not None:
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return
        self._proc.join(timeout_s)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()

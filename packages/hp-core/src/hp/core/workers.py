"""Worker processes of one node: spawn, log capture and exit status, one elastic PContext each.

``torch.distributed.elastic.multiprocessing`` does the spawning, log redirection/teeing with
per-rank prefixes and error-file capture. It treats a group of processes as one unit (any failure
closes all), so hp gives every worker its own single-process context: one worker can then die
and be restarted while its neighbours keep running.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, PContext, Std, start_processes
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


class WorkerLogsSpecs(LogsSpecs):
    """Logs of one worker under ``<log_dir>/<name>/attempt_<k>/{stdout,stderr}.log, error.json``
    where name is ``rank<R>`` or ``spare-<id>`` (a spare keeps its log name once promoted)."""

    def __init__(self, log_dir: str, name: str, tee: Std) -> None:
        super().__init__(log_dir, redirects=tee, tee=tee)
        self._name = name

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        attempt = envs[0].get("TORCHELASTIC_RESTART_COUNT", "0")
        d = os.path.join(self.root_log_dir, self._name, f"attempt_{attempt}")
        os.makedirs(d, exist_ok=True)
        tee = Std(self._tee) if not isinstance(self._tee, dict) else Std.NONE
        out, err = os.path.join(d, "stdout.log"), os.path.join(d, "stderr.log")
        error_file = os.path.join(d, "error.json")
        envs[0]["TORCHELASTIC_ERROR_FILE"] = error_file  # where ``@record`` writes the exception
        return LogsDest(
            stdouts={0: out if tee & Std.OUT else ""},
            stderrs={0: err if tee & Std.ERR else ""},
            tee_stdouts={0: out if tee & Std.OUT else ""},
            tee_stderrs={0: err if tee & Std.ERR else ""},
            error_files={0: error_file},
        )


@dataclass
class ExitStatus:
    """How a worker process ended."""

    pid: int
    exitcode: int
    signal: str | None  # e.g. "SIGKILL" when killed by a signal
    message: str  # from the worker's error file (``@record``), if it wrote one

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        return f"killed by {self.signal}" if self.signal else f"exit code {self.exitcode}"


@dataclass
class Worker:
    """One worker slot of this node: a global rank and the process currently holding it."""

    rank: int
    local_rank: int
    command: list[str]
    log_dir: str
    tee: Std
    restarts: int = 0
    spare_id: str | None = None  # set while (and after) this process was started as a hot spare
    holder: str = ""  # the controller's id of this process for its rank (see protocol.worker_holder)
    heartbeat_file: str = ""  # touched by hp.checkpointless workers; silence means a hang
    exit: ExitStatus | None = None
    _ctx: PContext | None = field(default=None, repr=False)
    pid: int = 0
    hung: bool = False

    @property
    def name(self) -> str:
        return f"spare-{self.spare_id}" if self.spare_id else f"rank{self.rank}"

    def start(self, env: dict[str, str]) -> None:
        env = {**env, "TORCHELASTIC_RESTART_COUNT": str(self.restarts)}
        self.exit = None
        self._ctx = start_processes(
            name=self.name,
            entrypoint=self.command[0],
            args={0: tuple(self.command[1:])},
            envs={0: env},
            logs_specs=WorkerLogsSpecs(self.log_dir, self.name, self.tee),
            log_line_prefixes={0: f"[{self.name}]:"},
        )
        self.pid = self._ctx.pids()[0]

    @property
    def running(self) -> bool:
        return self._ctx is not None and self.exit is None

    def poll(self) -> ExitStatus | None:
        """The exit status once the process has ended, else None. The process is polled directly
        (elastic's own poll first closes the context and its log tails, ~0.15 s that a failure
        report should not wait for); a failed worker's context is closed by :meth:`finish`."""
        if not self.running:
            return self.exit
        proc = self._ctx.subprocess_handlers[0].proc
        rc = proc.poll()
        if rc is None:
            return None
        self.exit = exit_status(proc.pid, rc, self._ctx.error_files[0])
        if rc == 0:
            self.finish()
        return self.exit

    def finish(self) -> None:
        """Close the ended process's context: flush and stop its log tails."""
        if self._ctx is not None:
            self._ctx.close()

    def silent_for(self) -> float:
        """Seconds since the worker last touched its heartbeat file (0 if it never did)."""
        try:
            return time.time() - os.stat(self.heartbeat_file).st_mtime
        except (OSError, ValueError):
            return 0.0

    def kill_hung(self) -> None:
        self.hung = True
        os.kill(self.pid, signal.SIGKILL)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self._ctx is not None:
            self._ctx.close(death_sig=sig, timeout=int(max(1, timeout_s)))


def exit_status(pid: int, rc: int, error_file: str) -> ExitStatus:
    """How a worker process ended, with the last line of what ``@record`` wrote to its error file."""
    if rc == 0:
        return ExitStatus(pid, 0, None, "")
    failure = ProcessFailure(local_rank=0, pid=pid, exitcode=rc, error_file=error_file)
    sig = failure.signal_name() if rc < 0 else None
    raw = failure.message
    raw = raw.get("message", "") if isinstance(raw, dict) else raw
    message = raw.strip().splitlines()[-1] if isinstance(raw, str) and raw.strip() else ""
    if message.startswith(("Signal ", "To enable traceback")):
        message = ""  # elastic's placeholder text, not something the worker said
    return ExitStatus(pid, rc, sig, message)


def python_command(entrypoint: str, args: list[str], module: bool) -> list[str]:
    """The command line of a worker, like torchrun's: unbuffered Python running the script, through
    :mod:`hp.core.worker_main` (which leaves SIGTERM to the agent first)."""
    return [sys.executable, "-u", "-m", "hp.core.worker_main", *(["-m"] if module else []), entrypoint, *args]

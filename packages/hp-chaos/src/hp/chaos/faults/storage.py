"""The ``storage`` fault: the job's S3 endpoint (SeaweedFS here) stops answering for a while.

Two ways, both real: ``stop`` freezes the server process (SIGSTOP, SIGCONT at the end: clients
see a server that accepts nothing and answers nothing, like a hung endpoint); ``block`` rejects
its port with an iptables rule (``REJECT --reject-with tcp-reset``: clients see the endpoint
refuse connections, like a dead one). The rule carries a comment naming the outage, so it is
removed exactly, even when the run ends early.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from hp.chaos.faults.base import AtStep, FaultKind, FaultSpec, Injection, JobShape, LiveJob, Param, positive
from hp.core.hookspecs import hookimpl
from hp.core.protocol import Event

MODES = ("stop", "block")


@dataclass(frozen=True)
class StorageServer:
    """A storage endpoint a fault can act on: its process and the port it serves S3 on."""

    pid: int
    port: int
    host: str = "127.0.0.1"


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Return once every thread of ``pid`` is stopped: kill() returns before a thread running on
    another core has stopped, and such a thread can still answer a request (seen with SeaweedFS)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return  # gone: nothing answers either
        states = []
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])  # the field after "(comm)"
            except FileNotFoundError:
                pass  # a thread that just exited
        if all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server pid {pid} did not stop within {timeout_s:g} s (thread states {states})")
        time.sleep(0.005)


class StorageOutage:
    """One outage of ``server``: :meth:`start` makes it unreachable, :meth:`end` undoes that
    (idempotent). Also a context manager."""

    def __init__(self, server: StorageServer, mode: str = "stop") -> None:
        if mode not in MODES:
            raise ValueError(f"storage outage mode must be one of {MODES}, got {mode!r}")
        self.server, self.mode, self.active = server, mode, False
        self._comment = f"hp-chaos-storage-{uuid.uuid4().hex[:12]}"

    def _rule(self) -> list[str]:
        return ["INPUT", "-p", "tcp", "-d", self.server.host, "--dport", str(self.server.port),
                "-m", "comment", "--comment", self._comment, "-j", "REJECT", "--reject-with", "tcp-reset"]

    @staticmethod
    def _iptables(*args: str) -> None:
        exe = shutil.which("iptables")
        if exe is None:
            raise RuntimeError("storage outage mode 'block' needs iptables (apt-get install iptables)")
        subprocess.run([exe, "-w", *args], check=True, capture_output=True, text=True)

    def start(self) -> None:
        if self.mode == "stop":
            os.kill(self.server.pid, signal.SIGSTOP)
            wait_stopped(self.server.pid)
        else:
            self._iptables("-I", *self._rule())
        self.active = True

    def end(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.mode == "stop":
            try:
                os.kill(self.server.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        else:
            self._iptables("-D", *self._rule())

    def __enter__(self) -> StorageOutage:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class OutageAt(AtStep):
    def ready(self, job: LiveJob) -> bool:
        return super().ready(job) and job.storage is not None

    def fire(self, job: LiveJob) -> Callable[[], None]:
        outage = StorageOutage(job.storage, self.spec.params["mode"])
        outage.start()
        self.record(job, mode=outage.mode)

        def undo() -> None:
            outage.end()
            job.record(Event.FAULT_RESUMED, fault=self.spec.index)
        return undo


class Storage(FaultKind):
    """The job's S3 endpoint is unreachable for duration_s: mode stop (SIGSTOP the server) or block (iptables REJECT its port)."""

    name, targets, event_trigger = "storage", ("storage",), True
    params = {"duration_s": Param(float, check=positive),
              "mode": Param(str, default="stop", check=lambda m: None if m in MODES else f"must be one of {list(MODES)}")}

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        return Injection(actions=[OutageAt(spec)])


@hookimpl
def hp_fault_kinds() -> list[FaultKind]:
    return [Storage()]

"""The ``store`` fault: the job's coordination store (etcd) stops answering for a while.

``{at_step: S, kind: store, target: store, duration_s: D}`` SIGSTOPs the job's etcd
(:meth:`hp.core.etcd_store.EtcdServer.pause`) while step ``S`` runs (or, with ``at_event``, at that
event) and SIGCONTs it ``duration_s`` later (:meth:`~hp.core.etcd_store.EtcdServer.resume`), or when
the run ends, whichever is first. Clients see a server that accepts connections and answers nothing,
like an etcd cluster that lost its quorum: every store read, write and watch (and an HA controller's
lease renewal) waits. Only for a job whose store is etcd (``job.store: etcd``): the runner starts
that etcd, and a ``tcp`` store lives inside the controller's process (a ``hang`` of ``controller``
freezes that one).
"""

from __future__ import annotations

from collections.abc import Callable

from hp.chaos.faults.base import (AtStep, FaultKind, FaultSpec, Injection, JobShape, LiveJob, Param,
                                  ScenarioError, positive)
from hp.chaos.faults.storage import wait_stopped
from hp.core.hookspecs import hookimpl
from hp.core.protocol import Event


class StorePause:
    """One pause of ``server`` (an :class:`~hp.core.etcd_store.EtcdServer`): :meth:`start` returns
    once every thread of etcd is stopped, :meth:`end` resumes it (idempotent). A context manager."""

    def __init__(self, server) -> None:
        self.server, self.active = server, False

    def start(self) -> None:
        self.server.pause()
        self.active = True
        wait_stopped(self.server.proc.pid)  # a thread on the other core may still answer otherwise

    def end(self) -> None:
        if self.active:
            self.active = False
            try:
                self.server.resume()
            except ProcessLookupError:
                pass  # etcd is gone (the run is ending): nothing to resume

    def __enter__(self) -> StorePause:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class PauseAt(AtStep):
    def ready(self, job: LiveJob) -> bool:
        return super().ready(job) and job.etcd is not None

    def fire(self, job: LiveJob) -> Callable[[], None]:
        pause = StorePause(job.etcd)
        try:
            pause.start()
        except BaseException:
            pause.end()
            raise
        self.record(job, pid=job.etcd.proc.pid, endpoint=job.etcd.endpoint)

        def undo() -> None:
            pause.end()
            job.record(Event.FAULT_RESUMED, fault=self.spec.index)
        return undo


class Store(FaultKind):
    """The job's etcd (job.store: etcd) answers nothing for duration_s: SIGSTOP, then SIGCONT."""

    name, targets, event_trigger = "store", ("store",), True
    params = {"duration_s": Param(float, check=positive)}

    def validate(self, raw: dict, key: str, index: int, job: JobShape) -> FaultSpec:
        spec = super().validate(raw, key, index, job)
        if job.store != "etcd":
            raise ScenarioError(f"{key}.kind", f"a store fault pauses the job's etcd: it needs job.store: etcd, "
                                               f"got {job.store!r}")
        return spec

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        return Injection(actions=[PauseAt(spec)])


@hookimpl
def hp_fault_kinds() -> list[FaultKind]:
    return [Store()]

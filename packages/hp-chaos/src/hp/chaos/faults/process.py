"""Process faults: ``kill``, ``hang``, ``exception``, ``slow``.

On a ``rank:N`` target they are injected in process (:mod:`hp.checkpointless.faults`), exact to
the step and phase, by whichever process holds the rank at that step (each fault fires once in
the job, so the replay of the failed step runs clean). On ``spare:N`` and ``controller`` the
runner sends the signal from outside while step ``at_step`` runs: a spare waits outside the step
loop, and the controller lives in node 0's agent, neither of which runs training steps. ``kill``
and ``hang`` with ``at_event`` are sent from outside too, on a rank to the process holding it when
the event is seen (a grow or a re-form has no step known in advance).

With ``job.store: etcd`` the agents elect the controller among them: ``controller`` is the agent of
the node leading when the fault fires (the last ``controller_elected`` decision's node; node 0
before any), so ``{kind: kill, target: controller}`` SIGKILLs that agent alone (its workers and
spares notice their agent is gone and exit; another agent's replica takes over), and with
``at_event`` it lands inside a re-form or a hydration (``failure_detected``, ``pg_ready``, ...).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from hp.chaos.faults.base import Action, AtStep, FaultKind, FaultSpec, Injection, JobShape, LiveJob, Param, positive
from hp.core.hookspecs import hookimpl
from hp.core.protocol import Event
from hp.core.warm_start import resolve


def _in_process(spec: FaultSpec, **extra) -> dict:
    return {"at_step": spec.at_step, "phase": spec.phase, "kind": spec.kind, "rank": spec.target.index, **extra}


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it died meanwhile (e.g. the agent killed a hung process): nothing left to do


class SignalAt(AtStep):
    """Send ``sig`` to a spare, to the controller's process or (``at_event``) to the process holding
    a rank while step ``at_step`` runs or at the event; ``resume`` (SIGCONT) undoes a SIGSTOP."""

    def __init__(self, spec: FaultSpec, sig: signal.Signals, resume: bool = False) -> None:
        super().__init__(spec)
        self.sig, self.resume = sig, resume

    def _pid(self, job: LiveJob) -> int | None:
        t = self.spec.target
        if t.kind == "rank":
            return job.rank_pid(t.index)
        if t.kind == "spare":
            return job.spare_pid(t.index)
        pid = job.controller_pid()  # an agent's process: its stand-in's, when the agent was forked warm
        return None if pid is None else resolve(pid)  # a SIGSTOP must stop the agent, not its stand-in

    def ready(self, job: LiveJob) -> bool:
        return super().ready(job) and self._pid(job) is not None

    def fire(self, job: LiveJob) -> Callable[[], None] | None:
        pid = self._pid(job)
        self.record(job, pid=pid, signal=self.sig.name)
        _signal(pid, self.sig)
        if not self.resume:
            return None

        def undo() -> None:
            _signal(pid, signal.SIGCONT)
            job.record(Event.FAULT_RESUMED, fault=self.spec.index, pid=pid)
        return undo


class ResumeHung(Action):
    """An in-process ``hang`` stops its own process; this sends it SIGCONT ``duration_s`` after the
    fault was recorded (if the agent's hang detection has not killed it first)."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec, self.duration_s, self._pid = spec, spec.params["duration_s"], None

    def ready(self, job: LiveJob) -> bool:
        s = self.spec
        for e in job.events():
            if (e["event"] == Event.FAULT_INJECTED and e.get("kind") == "hang" and e.get("rank") == s.target.index
                    and e.get("step") == s.at_step and e.get("phase") == s.phase):
                self._pid = e["pid"]
                return True
        return False

    def fire(self, job: LiveJob) -> Callable[[], None]:
        pid = self._pid

        def undo() -> None:
            _signal(pid, signal.SIGCONT)
            job.record(Event.FAULT_RESUMED, fault=self.spec.index, pid=pid)
        return undo


class Kill(FaultKind):
    """SIGKILL a process: a rank (in process, at a phase), a hot spare, or the controller's process."""

    name, targets, phased, event_trigger = "kill", ("rank", "spare", "controller"), True, True

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        if spec.target.kind == "rank" and spec.at_event is None:
            return Injection(hp_faults=[_in_process(spec)])
        return Injection(actions=[SignalAt(spec, signal.SIGKILL)])


class Hang(FaultKind):
    """SIGSTOP a process (a rank at a phase, a spare, the controller's process); with duration_s, SIGCONT it after that many seconds."""

    name, targets, phased, event_trigger = "hang", ("rank", "spare", "controller"), True, True
    params = {"duration_s": Param(float, optional=True, check=positive)}

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        if spec.target.kind == "rank" and spec.at_event is None:
            resume = [ResumeHung(spec)] if spec.params["duration_s"] else []
            return Injection(hp_faults=[_in_process(spec)], actions=resume)
        return Injection(actions=[SignalAt(spec, signal.SIGSTOP, resume=bool(spec.params["duration_s"]))])


class Exception_(FaultKind):
    """Raise inside the step at a phase of a rank: the CPU stand-in for a recoverable device error."""

    name, targets, phased = "exception", ("rank",), True

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        return Injection(hp_faults=[_in_process(spec)])


class Slow(FaultKind):
    """A straggler: the rank sleeps delay_s (default 0.2) at the phase of each of steps (default 5) steps; nothing fails."""

    name, targets, phased = "slow", ("rank",), True
    params = {"delay_s": Param(float, default=0.2, check=positive),
              "steps": Param(int, default=5, check=lambda n: None if n >= 1 else f"must be >= 1, got {n}")}

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        return Injection(hp_faults=[_in_process(spec, **spec.params)])


@hookimpl
def hp_fault_kinds() -> list[FaultKind]:
    return [Kill(), Hang(), Exception_(), Slow()]

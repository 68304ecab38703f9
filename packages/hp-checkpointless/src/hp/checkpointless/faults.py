"""Deterministic in-process fault injection at a step and phase (tests, `hp demo`, hp-chaos).

A plan is a JSON list in ``HP_FAULTS``:
``[{"at_step": 12, "phase": "allreduce", "kind": "kill", "rank": 1}]``. Kinds: ``kill`` (SIGKILL
itself), ``hang`` (SIGSTOP itself: only the agent's heartbeat watch notices), ``exception`` (raise
:class:`InjectedFault`, the CPU stand-in for a recoverable device error), ``unhealthy`` (the same, and
this process's device then fails its health check: the CPU stand-in for a device error that leaves
the device unusable, :mod:`hp.core.health`), ``slow`` (a straggler:
sleep ``delay_s`` at the phase of each of ``steps`` steps from ``at_step`` on; nothing fails).
Phases: ``forward``, ``backward``, ``allreduce``, ``commit``, ``optimizer``, ``hydration``. A fault
targets a rank, whoever holds it at that step (the process started as it, a spare promoted to it, a
restarted process, a process an elastic shrink renumbered to it), and fires once in the job: the
process about to inject it first claims it in the job's store (:data:`hp.core.protocol.FAULT_CLAIM_KEY`),
so the replay of the failed step, by whichever process, runs clean. ``slow`` fires once per step of
its window (recorded once).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from hp.core.protocol import FAULT_CLAIM_KEY

PHASES = ("forward", "backward", "allreduce", "commit", "optimizer", "hydration")
KINDS = ("kill", "hang", "exception", "slow", "unhealthy")


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault inside the step."""


@dataclass(frozen=True)
class Fault:
    at_step: int
    phase: str
    kind: str
    rank: int
    delay_s: float = 0.0  # slow only: seconds of sleep per step
    steps: int = 1  # slow only: how many consecutive steps are slowed

    @classmethod
    def parse(cls, raw: dict) -> Fault:
        try:
            fault = cls(int(raw["at_step"]), str(raw.get("phase", "forward")), str(raw["kind"]), int(raw["rank"]),
                        float(raw.get("delay_s", 0.0)), int(raw.get("steps", 1)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"HP_FAULTS: bad fault {raw!r}: {e}") from None
        if fault.phase not in PHASES or fault.kind not in KINDS:
            raise ValueError(f"HP_FAULTS: phase must be one of {PHASES} and kind one of {KINDS}: {raw!r}")
        if fault.delay_s < 0 or fault.steps < 1:
            raise ValueError(f"HP_FAULTS: delay_s must be >= 0 and steps >= 1: {raw!r}")
        return fault

    def covers(self, step: int) -> bool:
        return self.at_step <= step < self.at_step + (self.steps if self.kind == "slow" else 1)


class FaultPlan:
    """The faults planned for this job; ``claim(key)`` is True for the one caller that claims ``key`` first
    (the runtime's: an atomic add on the job's store)."""

    def __init__(self, faults: list[Fault], claim: Callable[[str], bool]) -> None:
        self.faults, self._claim = faults, claim
        self._seen: set[tuple[int, int]] = set()  # (fault index, step) this process already tried
        self.unhealthy = False  # an ``unhealthy`` fault fired here: this process's health check fails

    @classmethod
    def from_env(cls, claim: Callable[[str], bool], env=os.environ) -> FaultPlan:
        raw = env.get("HP_FAULTS", "").strip()
        return cls([Fault.parse(f) for f in json.loads(raw)] if raw else [], claim)

    def fire(self, step: int, phase: str, rank: int, record: Callable[[Fault], None]) -> None:
        """Inject the fault planned for (step, phase, rank), if no process did yet; ``record`` is called first."""
        for i, fault in enumerate(self.faults):
            if (fault.phase, fault.rank) != (phase, rank) or not fault.covers(step) or (i, step) in self._seen:
                continue
            self._seen.add((i, step))
            if not self._claim(FAULT_CLAIM_KEY.format(index=i, step=step)):
                continue  # fired already, in the process that held the rank before (this is a replay)
            if fault.kind == "slow":
                if step == fault.at_step:
                    record(fault)
                time.sleep(fault.delay_s)  # a straggler: the peers wait for it in the next collective
                continue
            record(fault)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                self.unhealthy = fault.kind == "unhealthy"
                raise InjectedFault(f"injected exception at step {step} ({phase}) on rank {rank}")

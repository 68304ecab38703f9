"""Deterministic in-process fault injection at a step and phase (tests, `hp demo`, hp-chaos).

A plan is a JSON list in ``HP_FAULTS``:
``[{"at_step": 12, "phase": "allreduce", "kind": "kill", "rank": 1}]``. Kinds: ``kill`` (SIGKILL
itself), ``hang`` (SIGSTOP itself: only the agent's heartbeat watch notices), ``exception`` (raise
:class:`InjectedFault`, the CPU stand-in for a recoverable device error), ``slow`` (a straggler:
sleep ``delay_s`` at the phase of each of ``steps`` steps from ``at_step`` on; nothing fails).
Phases: ``forward``, ``backward``, ``allreduce``, ``commit``, ``optimizer``, ``hydration``. A fault
fires once (``slow``: once per step of its window, recorded once), and only in the process that
first held the rank: never in a spare or a restarted process, so a replayed step runs clean, nor in
a process that an elastic shrink renumbered to that rank (``rank`` names the process started as it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

PHASES = ("forward", "backward", "allreduce", "commit", "optimizer", "hydration")
KINDS = ("kill", "hang", "exception", "slow")


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
    def __init__(self, faults: list[Fault], armed: bool) -> None:
        self.faults = faults
        self.armed = armed  # only the process that first held its rank injects
        self._fired: set[tuple[Fault, int]] = set()

    @classmethod
    def from_env(cls, env=os.environ) -> FaultPlan:
        raw = env.get("HP_FAULTS", "").strip()
        faults = [Fault.parse(f) for f in json.loads(raw)] if raw else []
        original = env.get("HP_ROLE", "worker") == "worker" and env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        return cls(faults, armed=original)

    def disarm(self) -> None:
        """A promoted spare never injects: its rank's faults belonged to the process it replaces."""
        self.armed = False

    def fire(self, step: int, phase: str, rank: int, record: Callable[[Fault], None]) -> None:
        """Inject the fault planned for (step, phase, rank), if any; ``record`` is called first."""
        if not self.armed:
            return
        for fault in self.faults:
            if (fault.phase, fault.rank) == (phase, rank) and fault.covers(step) and (fault, step) not in self._fired:
                self._fired.add((fault, step))
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
                    raise InjectedFault(f"injected exception at step {step} ({phase}) on rank {rank}")

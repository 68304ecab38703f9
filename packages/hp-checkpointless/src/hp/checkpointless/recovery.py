"""The recovery state machine of one rank: where it is in the step transaction, and what a failure means.

Pure (no torch, no processes, no clock): the runtime (:mod:`hp.checkpointless.runtime`) drives it from
the main thread, and the watch thread tells it the newest generation the controller published. Its
unit tests drive it directly, like :mod:`hp.core.controller`'s.

======================  =================================================================================
state                   meaning (and what a failure in it does)
======================  =================================================================================
``IDLE``                in no process group: before the first formation; a hot spare waits here for a rank
``FORMING``             joining generation g: store barrier, group init, agreement on the newest committed
                        step, hydration of the ranks behind it. Failure: re-form with generation g+1
``COMPUTING``           the user's code of a step runs (forward, backward, data). The only interruptible
                        state: a newer generation stops the step at once (signal or gradient hook; the
                        signal raises only inside ``with step:``, elsewhere the step's next check point
                        takes it). Failure: the step is replayed with the same batch
``COMMITTING``          hp's collectives of the step (gradient reduction, buffer broadcast, vote); never
                        interrupted midway, a dead peer surfaces as a collective error. Failure: replay
``FINISHING``           the vote passed: local optimizer update, scheduler, then post-commit replication.
                        Failure: the step stands (committed); only peers' copies need repair. If the
                        vote said a planned change is due (a grow, a graceful preemption), the rank
                        re-forms from here (FORMING) before the next step
``RECOVERING``          failed: the group is released; waiting for a newer generation to form
``CLOSED``              left the job (loop finished, job ended, or fenced out)
======================  =================================================================================

Thread rule: the watch thread only calls :meth:`RecoveryMachine.observe`; everything else runs on the
main thread (a signal handler runs there too, between two bytecodes). No lock: a lock held by the main
thread when its own signal handler asks for it would deadlock; every field is written by one thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class CollectiveError(RuntimeError):
    """A collective of the current generation failed or was aborted."""


class JobEnded(SystemExit):
    """The controller ended the job, or fenced this process out; exits non-zero quietly."""


class RankState(str, Enum):
    IDLE = "idle"
    FORMING = "forming"
    COMPUTING = "computing"
    COMMITTING = "committing"
    FINISHING = "finishing"
    RECOVERING = "recovering"
    CLOSED = "closed"


S = RankState
TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    S.IDLE: frozenset({S.FORMING, S.CLOSED}),
    S.FORMING: frozenset({S.COMPUTING, S.RECOVERING, S.CLOSED}),
    S.COMPUTING: frozenset({S.COMMITTING, S.RECOVERING, S.CLOSED}),
    S.COMMITTING: frozenset({S.FINISHING, S.RECOVERING, S.CLOSED}),
    S.FINISHING: frozenset({S.COMPUTING, S.FORMING, S.RECOVERING, S.CLOSED}),
    S.RECOVERING: frozenset({S.FORMING, S.CLOSED}),
    S.CLOSED: frozenset({S.CLOSED}),
}


@dataclass(frozen=True)
class Failure:
    """What the runtime does about a failure: which report the controller gets (None: the agent of a
    dead peer reports it) and whether the interrupted step is replayed."""

    report: str | None  # "exception": the failure is this rank's own (its step raised)
    replay: bool
    in_step: bool


class RecoveryMachine:
    def __init__(self) -> None:
        self.state = RankState.IDLE
        self.generation = 0  # of the group this rank is (or was last) in; 0: none yet
        self.latest = 0  # newest generation the watch thread has seen that abandons the current one
        self.boundary = 0  # newest planned generation seen (grow, preemption): taken at a step boundary
        self.finishing = False  # a plan said the job ends (hp finish): this rank votes to end after its step
        self._interrupt_sent = 0  # generation the main thread was last interrupted for

    def to(self, new: RankState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"hp.checkpointless: illegal recovery transition {self.state.value} -> {new.value}")
        self.state = new

    # ---- main thread ----------------------------------------------------------------------
    def forming(self, generation: int) -> None:
        """Entering generation ``generation`` (from IDLE, RECOVERING, or a re-form that failed)."""
        if self.state is not S.FORMING:
            self.to(S.FORMING)
        self.generation = generation

    def superseded(self) -> str | None:
        """Why no collective of this generation may start now (None: it may)."""
        if self.latest > self.generation:
            return f"generation {self.generation} superseded by {self.latest}"
        return None

    def take_interrupt(self) -> bool:
        """Main thread (signal handler, gradient hook): stop the user's step now? True at most once per
        step, and only while user code runs: never inside hp's collectives or the commit tail."""
        if self.state is S.COMPUTING and self.latest > self.generation:
            self.to(S.RECOVERING)
            return True
        return False

    def failed(self, in_step: bool) -> Failure:
        """A failure surfaced in the main thread; ``in_step``: raised by the user's own step code (not
        by a collective or an interrupt). Moves to RECOVERING."""
        was = self.state
        if was is not S.RECOVERING:
            self.to(S.RECOVERING)
        return Failure(report="exception" if in_step else None, replay=was is not S.FINISHING, in_step=in_step)

    # ---- watch thread -----------------------------------------------------------------------
    def boundary_due(self) -> bool:
        """Whether this rank has seen a planned generation it has not formed yet (its vote says so)."""
        return self.boundary > self.generation

    def observe(self, latest: int, at_boundary: bool = False, finishing: bool = False) -> bool:
        """The watch thread saw generation ``latest`` published. True: signal the main thread, its
        step computes for a group that is already dead (once per generation). A planned generation
        (``at_boundary``) interrupts nothing: the ranks agree in a commit vote to re-form after it.
        ``finishing``: its plan says the job ends; the ranks agree in a commit vote on the step it ends after."""
        self.finishing = self.finishing or finishing
        if at_boundary:
            self.boundary = max(self.boundary, latest)
            return False
        self.latest = max(self.latest, latest)
        if self.state is S.COMPUTING and self.latest > self.generation and self._interrupt_sent < self.latest:
            self._interrupt_sent = self.latest
            return True
        return False

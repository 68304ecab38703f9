"""The recovery path of a survivor: from a failed step to the next generation, and the planned re-form.

:mod:`hp.checkpointless.recovery` says where a rank is and what a failure means (pure); this module
does it, with the process group and the training state in hand: record the failure, let go of the
failed group, check the device's health, roll the step back, tell the controller when the failure is
this rank's own, and re-form (:meth:`hp.checkpointless.formation.Formation.reform`). Survivors never
re-import torch or rebuild anything; the step is replayed with the same batch by the step loop.
"""

from __future__ import annotations

import sys
import traceback

from hp.checkpointless.hooks import Hooks
from hp.checkpointless.recovery import CollectiveError, JobEnded, RankState
from hp.checkpointless.registry import TrainingState
from hp.checkpointless.transaction import StepTransaction
from hp.checkpointless.wiring import Wiring
from hp.core.health import EXIT_UNHEALTHY, first_failure
from hp.core.plugins import backends
from hp.core.protocol import Event


class Recovery:
    def __init__(self, wiring: Wiring, hooks: Hooks, st: TrainingState, tx: StepTransaction) -> None:
        self._wiring, self._hooks, self._st, self._tx = wiring, hooks, st, tx

    def recover(self, step: int, exc: Exception) -> None:
        """``exc`` ended ``step`` on this rank (its own code raised, a collective failed, or the
        interrupt stopped it): back to the last committed state, in the next generation's group."""
        w = self._wiring
        w.leave_if_orphaned()  # the peer that failed left because the agent died: so must this rank
        failure = w.machine.failed(in_step=not isinstance(exc, CollectiveError))
        failed_generation = w.machine.generation
        w.events.record(Event.FAILURE_DETECTED, step=int(step), rank=w.formation.rank, generation=failed_generation,
                        error=f"{type(exc).__name__}: {exc}"[:300], in_step=failure.in_step, replay=failure.replay)
        drop_frames(exc)
        w.link.release()
        self.check_health()
        self._tx.abort()
        self._st.rollback()
        if failure.report is not None:
            w.formation.report(failure.report, f"{type(exc).__name__}: {exc}")
        w.formation.reform(self._st, self._tx, failed_generation + 1,
                           on_slow=lambda: w.formation.report("collective", str(exc)))
        self._hooks.formed(self._st)

    def rescale(self) -> None:
        """A planned generation (grow, graceful preemption) at a step boundary every rank agreed on in
        the last vote: leave this group cleanly and form the new one (nothing to roll back or replay)."""
        w, st = self._wiring, self._st
        w.events.record(Event.RESCALING, rank=w.formation.rank, step=st.committed, generation=w.machine.generation)
        w.link.release()
        w.machine.to(RankState.FORMING)
        w.formation.reform(st, self._tx, w.machine.generation + 1)
        self._hooks.formed(st)

    def check_health(self) -> None:
        """After a failure, before re-entering: this rank's device passes every health check that applies
        (:mod:`hp.core.health`, family ``health``), or the process leaves and a spare takes its rank."""
        w = self._wiring
        if w.faults.unhealthy:  # the CPU stand-in for a device left unusable: no real check to run
            failed = ("injected", "an injected fault left this device unusable")
        else:
            failed = first_failure(backends("health").values(), str(w.device))
        if failed is None:
            return
        check, reason = failed
        rank = w.formation.rank
        w.events.record(Event.HEALTH_CHECK_FAILED, rank=rank, check=check, reason=reason[:300])
        print(f"hp: rank {rank}: health check {check!r} failed ({reason}); leaving for a spare",
              file=sys.stderr, flush=True)
        raise JobEnded(EXIT_UNHEALTHY)


def drop_frames(exc: BaseException) -> None:
    """The frames of a collective that failed inside torch (FSDP's, in backward) hold its group, in the
    exception's traceback and in those of the exceptions it was raised while handling (torch's logging
    wrapper raises a second one): they let go of it before the group is destroyed (group.py)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__context__ or exc.__cause__


def release_holders(st: TrainingState | None) -> None:
    """Whatever holds the failed group besides the transport lets go of it first: a sharded
    optimizer's reference alone would keep the group and its sockets alive."""
    if st is not None and st.sharded is not None:
        st.sharded.unbind()

"""Joining a generation: wait for its plan, pass the fence, form the group, agree, hydrate.

Used at start (a worker joins generation 1; a hot spare first waits for the controller to give it a
rank), and after every failure (:meth:`Formation.reform`). A re-form that fails (a peer died while
forming, a transfer broke) is retried with the next generation; one that fails on every rank while no
process died is reported to the controller, since no agent will (DESIGN.md lessons).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from hp.checkpointless import hydration, ladder, membership, sharded, state
from hp.checkpointless.events import EventLog
from hp.checkpointless.group import GroupLink
from hp.checkpointless.recovery import CollectiveError, JobEnded, RecoveryMachine
from hp.checkpointless.registry import TrainingState
from hp.checkpointless.transaction import StepTransaction
from hp.core.control_plane import ControlClient
from hp.core.errors import ControlPlaneError
from hp.core.protocol import STATE_NBYTES_KEY, Event, FailureAction, JobState, Plan, Verb

EXIT_ESCALATED = 75  # EX_TEMPFAIL: this rank keeps failing; the agent replaces the process


class Formation:
    def __init__(self, *, rank: int, spare_id: str | None, node_rank: int, holder: str, store: dist.Store,
                 controller: ControlClient, machine: RecoveryMachine, link: GroupLink, events: EventLog,
                 fire: Callable[[int, str], None]) -> None:
        self.rank, self.spare_id, self.node_rank, self.holder = rank, spare_id, node_rank, holder
        self._store, self._controller, self._machine, self._link = store, controller, machine, link
        self._events, self._fire = events, fire
        self._agree: torch.Tensor | None = None  # kept referenced: see group.py

    def join(self, st: TrainingState, tx: StepTransaction, start_generation: int, disarm: Callable[[], None]) -> None:
        """First formation; a hot spare waits here for a rank (``disarm``: a spare never injects faults)."""
        if self.spare_id is None:
            self.reform(st, tx, start_generation)
            return
        self._prepare_receive_buffer(st, self._store)  # now, if the job published its size: ready means ready
        cpu = os.times()
        self._events.record(Event.SPARE_READY, spare=self.spare_id, cpu_s=round(cpu.user + cpu.system, 3))
        try:
            self._controller.call(Verb.SPARE_READY, {"node_rank": self.node_rank, "spare": self.spare_id})
        except ControlPlaneError as e:  # best effort: a spare never heard from is still promoted when none is ready
            self._events.record(Event.SPARE_READY_UNREPORTED, spare=self.spare_id, error=str(e)[:300])
        self.rank, generation = membership.wait_for_assignment(
            self._store, self.spare_id, on_idle=lambda store: self._prepare_receive_buffer(st, store))
        self._events.record(Event.ASSIGNED, spare=self.spare_id, rank=self.rank, generation=generation)
        disarm()
        self.reform(st, tx, generation)

    def _prepare_receive_buffer(self, st: TrainingState, store: dist.Store) -> None:
        """Spare, while waiting: allocate and fault in the buffer a hydration will land in. Page faults
        into fresh memory cost several times the transfer itself (INFRA.md "Measured floors")."""
        if st.receive_buffer is not None or not store.check([STATE_NBYTES_KEY]):
            return
        nbytes = int(store.get(STATE_NBYTES_KEY))
        # 1/64 of headroom, rounded to 64 bytes: the optimizer keeps views into these bytes, and torch.save
        # of a float view into a storage whose size is no multiple of the element size cannot be loaded
        size = -(-(nbytes + (nbytes >> 6)) // 64) * 64
        st.receive_buffer = state.StateBuffer(None, torch.zeros(size, dtype=torch.uint8))
        self._events.record(Event.RECEIVE_BUFFER_READY, nbytes=nbytes)

    def publish_state_size(self, st: TrainingState) -> None:
        """Rank 0, once: the size of a full hydration, so that spares pre-fault a receive buffer of it."""
        if st.sharded is None and self.rank == 0:
            self._store.set(STATE_NBYTES_KEY, str(state.wire_nbytes(st.capture())))

    def report(self, reason: str, message: str) -> None:
        """Tell the controller this rank failed (``reason``: exception, collective, unrecoverable)."""
        try:
            answer = self._controller.call(Verb.RANK_FAILED, {
                "node_rank": self.node_rank, "generation": self._machine.generation, "rank": self.rank,
                "reason": reason, "message": message[:500]})
        except ControlPlaneError as e:
            if e.status == 409:
                return  # someone already moved the job to a newer generation
            raise
        if answer.get("action") == FailureAction.EXIT:
            self._events.record(Event.ESCALATED, rank=self.rank, reason=answer.get("reason"))
            raise JobEnded(EXIT_ESCALATED)

    def reform(self, st: TrainingState, tx: StepTransaction, minimum: int,
               on_slow: Callable[[], None] | None = None) -> None:
        """Form the newest generation >= ``minimum`` and bring this rank to the agreed step,
        retrying with the next generation if a peer fails meanwhile."""
        while True:
            plan = membership.wait_for_generation(self._store, minimum, on_slow=on_slow)
            if plan.state is not JobState.RUNNING:
                raise JobEnded(f"hp: job {plan.state}: {plan.reason}")
            try:
                self._form(st, tx, plan)
                return
            except sharded.ShardLost as e:
                self.report("unrecoverable", str(e))
                raise JobEnded(f"hp: {e}") from None
            except (CollectiveError, membership.Superseded, state.StateTransferError, RuntimeError) as e:
                self._events.record(Event.REFORM_FAILED, generation=plan.generation, rank=self.rank, error=str(e)[:300])
                self._link.release()
                self._machine.failed(in_step=False)
                # a dead peer is reported by its agent; a failure every process survived (every rank
                # inside this re-form, none in a step) is reported by nobody else: ask when it is slow
                message = f"re-forming generation {plan.generation} failed: {e}"
                minimum, on_slow = plan.generation + 1, lambda message=message: self.report("collective", message)

    def _form(self, st: TrainingState, tx: StepTransaction, plan: Plan) -> None:
        if plan.holders.get(self.rank) != self.holder:
            self._events.record(Event.FENCED_OUT, rank=self.rank, generation=plan.generation, holder=self.holder)
            raise JobEnded(f"hp: fenced out: rank {self.rank} of generation {plan.generation} is held by "
                           f"{plan.holders.get(self.rank)!r}, not by this process ({self.holder!r})")
        self._machine.forming(plan.generation)
        membership.arrive(self._store, plan.generation, plan.world_size)
        self._link.form(self.rank, plan.world_size, plan.generation)
        self._events.record(Event.PG_READY, generation=plan.generation, rank=self.rank)
        if st.factories is not None:
            st.build_optimizer()
        sh = st.sharded
        if sh is not None:
            sh.rebind(self.rank, plan.world_size)
        # every rank's committed step (row 0) and, with a sharded optimizer, its shard versions (rows 1-3)
        info = self._agree = torch.zeros(4, plan.world_size, dtype=torch.int64)
        info[:, self.rank] = torch.tensor([st.committed, sh.version if sh else -1,
                                           sh.replica_version if sh else -1, tx.grads_step])
        self._link.collective(dist.all_reduce, info)
        newest = int(info[0].max())
        agreement = hydration.Agreement(
            plan.generation, newest, source=int((info[0] == newest).nonzero()[0]),
            behind=[r for r in range(plan.world_size) if info[0, r] < newest], versions=sharded.Versions(*info.tolist()))
        if agreement.behind:
            self._fire(newest, "hydration")
        if newest < 0 and self.restore(st, "job start"):
            pass  # a job started again: the newest checkpoint, if there is one
        elif sh is None:
            hydration.replicated(st, agreement, self.rank, self._events)
        else:
            try:
                hydration.sharded_optimizer(st, tx, agreement, self.rank, self._link.collective, self._events)
            except sharded.ShardLost as e:  # no peer has it: down the ladder, if there is a checkpoint
                if not self.restore(st, str(e)):
                    raise
        self._events.record(Event.RESUMED, rank=self.rank, step=st.committed, generation=plan.generation)

    def restore(self, st: TrainingState, why: str) -> bool:
        """Job-level rung: every rank loads the newest checkpoint (a collective decision)."""
        found = ladder.restore(st, self.rank) if st.checkpoint is not None else None
        if found is None:
            return False
        step, tier = found
        st.mark_committed(step)
        if st.sharded is not None:
            st.sharded.replicate(self.rank, self._link.collective)
        self._events.record(Event.RESTORED, rank=self.rank, step=step, tier=tier, why=why[:300],
                            generation=self._machine.generation)
        if self.rank == 0:
            print(f"hp: restored step {step} from the {tier} tier ({why})", file=sys.stderr, flush=True)
        return True

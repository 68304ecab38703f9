"""Joining a generation: wait for its plan, pass the fence, form the group, agree, hydrate.

Used at start (a worker joins generation 1; a hot spare first waits for the controller to give it a
rank), and after every failure (:meth:`Formation.reform`). A re-form that fails (a peer died while
forming, a transfer broke) is retried with the next generation; one that fails on every rank while no
process died is reported to the controller, since no agent will (DESIGN.md lessons).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hp.checkpointless import hydration, ladder, membership, replicas, sharded, shm, state
from hp.checkpointless.agreement import Agreement
from hp.checkpointless.events import EventLog
from hp.checkpointless.group import GroupLink
from hp.checkpointless.recovery import CollectiveError, JobEnded, RecoveryMachine
from hp.checkpointless.registry import TrainingState
from hp.checkpointless.transaction import StepTransaction
from hp.core.control_plane import ControlClient
from hp.core.errors import ControlPlaneError
from hp.core.fanout import Mirror
from hp.core.protocol import RESIZES, STATE_NBYTES_KEY, Event, FailureAction, JobState, Plan, Verb
from hp.core.signed_values import Refusals, sealing

EXIT_ESCALATED = 75  # EX_TEMPFAIL: this rank keeps failing; the agent replaces the process


class Formation:
    def __init__(self, *, rank: int, spare_id: str | None, node_rank: int, holder: str, store: dist.Store,
                 token: str, controller: ControlClient, machine: RecoveryMachine, link: GroupLink, events: EventLog,
                 fire: Callable[[int, str], None], refusals: Refusals | None = None,
                 channel: Mirror | None = None, local_rank: int = -1) -> None:
        self.rank, self.spare_id, self.node_rank, self.holder = rank, spare_id, node_rank, holder
        self.local_rank = local_rank  # its device on the node (WorkerEnv.local_rank): a spare keeps it when promoted
        self._store, self._controller, self._machine, self._link = store, controller, machine, link
        self._view = membership.JobView(store, token, refusals, channel)  # the sealed values this process acts on
        self._publish = sealing(store.set, token)
        self._events, self._fire = events, fire
        self._agree: torch.Tensor | None = None  # kept referenced: see group.py
        self._agree_ring: torch.Tensor | None = None  # the held ring, agreed (kept referenced too)
        self._assigned = 0  # a hot spare: the generation that gave it its rank
        self._entered: Plan | None = None  # formed by enter_first, not settled yet
        self._retry = 0  # the generation to form first after enter_first failed

    def join(self, st: TrainingState, tx: StepTransaction, start_generation: int) -> None:
        """First formation; a hot spare waits here for a rank (unless :meth:`assign` already did)."""
        if self.spare_id is not None and self.rank < 0:
            self.assign(st)
        self.reform(st, tx, self._first_generation(start_generation))

    def enter_first(self, start_generation: int) -> None:
        """Form the first generation's process group before the training state exists (a device mesh needs
        one to shard the model on); :meth:`join` agrees and hydrates in it. Retried with the next
        generation while a peer fails meanwhile."""
        minimum, on_slow = self._first_generation(start_generation), None
        while True:
            plan = membership.wait_for_generation(self._view, minimum, on_slow=on_slow)
            if plan.state is not JobState.RUNNING:
                raise JobEnded(f"hp: job {plan.state}: {plan.reason}")
            try:
                self._enter(plan, -1)
                self._entered = plan
                return
            except membership.JobFinished as e:
                self._left(plan, -1, e)
            except sharded.ShardLost as e:  # a mesh this generation cannot shard (a RuntimeError: not retried)
                minimum = self._retry = self._unformable(plan, e)
                on_slow = None
            except (CollectiveError, membership.Superseded, RuntimeError) as e:
                self._failed(plan, e)
                message = f"forming generation {plan.generation} failed: {e}"  # see reform
                minimum = self._retry = plan.generation + 1
                on_slow = lambda message=message: self.report("collective", message)  # noqa: E731

    def _first_generation(self, start_generation: int) -> int:
        return max(self._assigned if self.spare_id is not None else start_generation, self._retry)

    def assigned_world(self) -> int | None:
        """A hot spare given a rank: the world size of the generation that gave it (None: not a spare, or
        that plan is gone)."""
        if self.spare_id is None or self.rank < 0:
            return None
        plan = self._view.plan(self._assigned)
        return plan.world_size if plan is not None else None

    def assign(self, st: TrainingState | None) -> int:
        """A hot spare: say it is ready, wait until the controller gives it a rank; returns the rank.
        ``st``: the training state when registered (a receive buffer for its hydration is prepared while
        it waits), None for a spare that needs its rank before it can build its model (a device mesh)."""
        if st is not None:
            self._prepare_receive_buffer(st, self._view)  # now, if the job published its size: ready means ready
        cpu = os.times()
        self._events.record(Event.SPARE_READY, spare=self.spare_id, cpu_s=round(cpu.user + cpu.system, 3),
                            local_rank=self.local_rank)  # its device, before any rank
        try:
            self._controller.call(Verb.SPARE_READY, {"node_rank": self.node_rank, "spare": self.spare_id})
        except ControlPlaneError as e:  # best effort: a spare never heard from is still promoted when none is ready
            self._events.record(Event.SPARE_READY_UNREPORTED, spare=self.spare_id, error=str(e)[:300])
        idle = (lambda view: self._prepare_receive_buffer(st, view)) if st is not None else None
        self.rank, self._assigned = membership.wait_for_assignment(self._view, self.spare_id, on_idle=idle)
        if st is not None and st.premaps is not None:  # a rank now: what it offered stays mapped where it was
            st.premaps.withdraw(self.spare_id)
        self._events.record(Event.ASSIGNED, spare=self.spare_id, rank=self.rank, generation=self._assigned)
        return self.rank

    def _prepare_receive_buffer(self, st: TrainingState, view: membership.JobView) -> None:
        """Spare, while waiting: allocate and fault in the buffer a hydration will land in. Page faults
        into fresh memory cost several times the transfer itself (INFRA.md "Measured floors"). A forged
        size (one that would exhaust this host's memory, say) is refused: no buffer, until a genuine one."""
        if st.receive_buffer is not None:
            return
        nbytes = view.state_nbytes()
        if nbytes is None:
            return
        # 1/64 of headroom, rounded to 64 bytes: the optimizer keeps views into these bytes, and torch.save
        # of a float view into a storage whose size is no multiple of the element size cannot be loaded
        size = -(-(nbytes + (nbytes >> 6)) // 64) * 64
        try:  # shared with the node: a source on it packs the state straight into it (hp.checkpointless.shm)
            st.receive_shared = shm.SharedBuffer.create(size)
            data = st.receive_shared.tensor
        except OSError:
            data = torch.zeros(size, dtype=torch.uint8)
        st.receive_buffer = state.StateBuffer(None, data)
        placed = state.place_parameters(st.model, data)  # where the hydration will write them: adopted, not copied
        if st.receive_shared is not None and st.premaps is not None:  # for its node's sources to map it now
            st.premaps.offer(self.spare_id, st.receive_shared)
        self._events.record(Event.RECEIVE_BUFFER_READY, nbytes=nbytes, shared=st.receive_shared is not None,
                            placed=placed)
        gc.collect()  # the garbage of building the model and moving its parameters: freed now, not in a hydration

    def publish_state_size(self, st: TrainingState) -> None:
        """Rank 0, once: the size of a full hydration, so that spares pre-fault a receive buffer of it."""
        if st.sharded is None and st.fsdp is None and self.rank == 0:
            self._publish(STATE_NBYTES_KEY, str(state.wire_nbytes(st.capture())))

    def report(self, reason: str, message: str) -> bool:
        """Tell the controller this rank failed (``reason``: exception, collective, unrecoverable). False when
        the report was refused as stale: the job has already moved to a newer generation."""
        try:
            answer = self._controller.call(Verb.RANK_FAILED, {
                "node_rank": self.node_rank, "generation": self._machine.generation, "rank": self.rank,
                "holder": self.holder, "reason": reason, "message": message[:500]})
        except ControlPlaneError as e:
            if e.status == 409:
                return False  # someone already moved the job to a newer generation
            raise
        if answer.get("action") == FailureAction.EXIT:
            self._events.record(Event.ESCALATED, rank=self.rank, reason=answer.get("reason"))
            raise JobEnded(EXIT_ESCALATED)
        return True

    def _unformable(self, plan: Plan, error: sharded.ShardLost) -> int:
        """A generation this rank cannot take part in (a mesh it cannot shard, a shard lost): the job ends with
        the reason, unless the controller has already moved on to a newer generation (the report is refused
        as stale), which may well be formable (a replacement joined back): then that one is tried. Returns
        the next generation to wait for."""
        if self.report("unrecoverable", str(error)):
            raise JobEnded(f"hp: {error}") from None
        self._failed(plan, error)
        return plan.generation + 1

    def reform(self, st: TrainingState, tx: StepTransaction, minimum: int,
               on_slow: Callable[[], None] | None = None) -> None:
        """Form the newest generation >= ``minimum`` and bring this rank to the agreed step,
        retrying with the next generation if a peer fails meanwhile."""
        while True:
            plan, entered = self._entered, self._entered is not None  # formed before the state existed
            self._entered = None
            if plan is None or plan.generation < minimum:
                plan, entered = membership.wait_for_generation(self._view, minimum, on_slow=on_slow), False
                if plan.state is JobState.PREEMPTED:
                    self._save_for_preemption(st, tx, plan)
                if plan.state is not JobState.RUNNING:
                    raise JobEnded(f"hp: job {plan.state}: {plan.reason}")
            try:
                if not entered:
                    self._enter(plan, st.committed)
                self._settle(st, tx, plan)
                return
            except membership.JobFinished as e:  # a joiner of a grow decided during the last steps
                self._left(plan, st.committed, e)
            except sharded.ShardLost as e:
                minimum, on_slow = self._unformable(plan, e), None
            except (CollectiveError, membership.Superseded, state.StateTransferError, RuntimeError) as e:
                self._failed(plan, e)
                # a dead peer is reported by its agent; a failure every process survived (every rank
                # inside this re-form, none in a step) is reported by nobody else: ask when it is slow
                message = f"re-forming generation {plan.generation} failed: {e}"
                minimum, on_slow = plan.generation + 1, lambda message=message: self.report("collective", message)

    def _left(self, plan: Plan, step: int, why: Exception) -> NoReturn:
        self._events.record(Event.LEFT, rank=self.rank, generation=plan.generation, holder=self.holder,
                            step=step, why=str(why))
        raise JobEnded(0) from None

    def _failed(self, plan: Plan, error: Exception) -> None:
        self._events.record(Event.REFORM_FAILED, generation=plan.generation, rank=self.rank, error=str(error)[:300])
        self._link.release()
        self._machine.failed(in_step=False)

    def _save_for_preemption(self, st: TrainingState, tx: StepTransaction, plan: Plan) -> NoReturn:
        """The job is preempted (the tiered-checkpoint rung of graceful preemption): the plan keeps every
        rank, so form its group, agree on the newest committed step (ranks behind hydrate, as in any
        re-form), save it through the job's checkpoint, urgently, and end. A failure here ends the process:
        the job restarts from the newest complete checkpoint, an older one."""
        if st.checkpoint is None:  # the same on every rank: none of them forms
            if self.rank == 0:
                print(f"hp: job preempted ({plan.reason}); no checkpoint is registered: nothing saved",
                      file=sys.stderr, flush=True)
            raise JobEnded(0)
        try:
            self._enter(plan, st.committed)  # every rank forms: whether a step was committed is agreed here
            self._settle(st, tx, plan)
            if st.committed < 0:
                raise JobEnded(0)
            ladder.save(st, self.rank, st.committed, urgent=True)
        except (CollectiveError, membership.Superseded, state.StateTransferError, RuntimeError, CheckpointException) as e:
            self._events.record(Event.CHECKPOINT_FAILED, rank=self.rank, step=st.committed, error=str(e)[:300])
            raise JobEnded(f"hp: job preempted; saving step {st.committed} failed: {e}") from None
        self._events.record(Event.PREEMPT_SAVED, rank=self.rank, step=st.committed, generation=plan.generation)
        if self.rank == 0:
            print(f"hp: job preempted ({plan.reason}): saved step {st.committed}; a restart resumes from it",
                  file=sys.stderr, flush=True)
        raise JobEnded(0)

    def _enter(self, plan: Plan, step: int) -> None:
        """Pass the fence and form the generation's process group (``step``: this rank's committed one)."""
        rank = plan.rank_of(self.holder)
        if rank is None and (plan.at_boundary or plan.why in RESIZES):
            self._events.record(Event.LEFT, rank=self.rank, generation=plan.generation, holder=self.holder,
                                step=step, why=plan.why)
            print(f"hp: rank {self.rank} left the job ({plan.why}, generation {plan.generation})",
                  file=sys.stderr, flush=True)
            raise JobEnded(0)
        if rank is None:
            self._events.record(Event.FENCED_OUT, rank=self.rank, generation=plan.generation, holder=self.holder)
            raise JobEnded(f"hp: fenced out: rank {self.rank} of generation {plan.generation} is held by "
                           f"{plan.holders.get(self.rank)!r}, not by this process ({self.holder!r})")
        self.rank = rank  # scale events renumber ranks: a process is known by its holder id
        self._machine.forming(plan.generation)
        membership.arrive(self._view, plan.generation, plan.world_size)
        self._link.form(self.rank, plan.world_size, plan.generation, plan.forming_store)
        self._events.record(Event.PG_READY, generation=plan.generation, rank=self.rank)

    def _settle(self, st: TrainingState, tx: StepTransaction, plan: Plan) -> None:
        """In the formed group: agree on the newest committed step and bring every rank to it."""
        if st.factories is not None:
            st.build_optimizer()
        sh, fs = st.sharded, st.fsdp
        # with a sharded optimizer, the partitioning its shards are in (a scale event changes it); an FSDP
        # model's shards (pure FSDP: replicated along a ring) are its rank's of the mesh's world
        before, held_ring = (-1, -1), ()
        if sh is not None and sh.version >= 0:
            before, held_ring = sh.partition, sh.held_ring
        elif fs is not None and fs.version >= 0 and fs.buddies:
            before, held_ring = (self.rank, fs.mesh.layout.world), fs.ring or replicas.identity(fs.mesh.layout.world)
        if sh is not None:
            sh.rebind(self.rank, plan.world_size)
        # every rank's committed step (row 0); with sharded state its versions (rows 1-3: its own shard's
        # step, its copy of its ward's, the step of the reduced gradients it holds; row 10: the step of the
        # gradients that came with that copy, FSDP) and the rank and world size of its shard's partitioning
        # (rows 4-5); its node (row 6: a new replication ring puts a rank's buddy on another node), whether
        # its shards replicate along a ring other than the identity (row 7), the samples consumed through
        # its committed step (row 8: with a per-replica batch, a function of the world-size history) and the
        # world size its state is for (row 9: the LR of a policy that scales it); an FSDP model's newest
        # committed step the job skipped (row 11: a GradScaler saw inf/NaN; a roll-forward of it updates nothing)
        shard, replica, replica_grads = -1, -1, -1
        if sh is not None:
            shard, replica = sh.version, sh.replica_version
        elif fs is not None:
            shard, replica, replica_grads = fs.version, fs.replica_at, fs.replica_grads
        info = self._agree = torch.zeros(12, plan.world_size, dtype=torch.int64)
        info[:, self.rank] = torch.tensor([st.committed, shard, replica, tx.grads_step, *before, self.node_rank,
                                           int(held_ring != replicas.identity(len(held_ring))),
                                           st.samples, st.world, replica_grads, fs.skipped if fs is not None else -1])
        self._link.collective(dist.all_reduce, info)
        newest = int(info[0].max())
        source = int((info[0] == newest).nonzero()[0])
        worlds = {w for w in info[5].tolist() if w >= 0}
        if len(worlds) > 1:  # a reshard's last step ran on some ranks only: they no longer hold the old shards
            raise sharded.ShardLost(f"ranks hold optimizer shards of different partitionings (world sizes "
                                    f"{sorted(worlds)}): the sharded state is lost")
        previous_world, ring = max(worlds, default=-1), ()
        if previous_world >= 0 and bool(info[7].any()):
            # the held partitioning's ring, from its lowest holder (a fresh process or a joiner lacks it)
            held = self._agree_ring = torch.zeros(previous_world, dtype=torch.int64)
            if self.rank == int((info[4] >= 0).nonzero()[0]):
                held.copy_(torch.tensor(held_ring))
            self._link.collective(dist.all_reduce, held)
            ring = tuple(held.tolist())
        # behind: older than the newest step, or at it with state for another world size (a rank whose
        # last formation succeeded where a peer's failed applied on_scale alone): both take the source's
        agreement = Agreement(
            plan.generation, newest, source=source,
            behind=[r for r in range(plan.world_size) if info[0, r] < newest or info[9, r] != info[9, source]],
            versions=sharded.Versions(*info[:4].tolist()), previous_world=previous_world,
            previous_ranks=tuple(info[4].tolist()), ring=ring, replica_grads=tuple(info[10].tolist()),
            nodes=tuple(info[6].tolist()), skipped=int(info[11].max()))
        # the same partitioning keeps its ring; a new one gets a ring across nodes
        same = previous_world == plan.world_size and not agreement.resharding(plan.world_size)
        if sh is not None:
            sh.set_ring(ring if same else replicas.node_ring(info[6].tolist()))
        elif fs is not None and fs.buddies:
            fs.ring = ring if same else replicas.node_ring(info[6].tolist())
        elif fs is not None:  # HSDP: no ring (an elastic job grown back from one replica group drops its shadow)
            fs.ring, fs.shadow = (), None
        if st.premaps is not None:  # the two lowest ranks of each node map its spares' buffers early
            st.premaps.active = sh is None and fs is None and self.rank in agreement.node_sources(self.rank)
        if agreement.behind:
            self._fire(newest, "hydration")
        st.samples, st.world = int(info[8, source]), int(info[9, source])  # what the hydrated state is at
        if newest < 0 and self.restore(st, "job start"):
            pass  # a job started again: the newest checkpoint, if there is one
        elif fs is not None:
            try:
                hydration.fsdp_shards(st, agreement, self.rank, self._link.collective, self._events)
            except sharded.ShardLost as e:  # a shard with every copy of it lost: down the ladder, if there is one
                if not self.restore(st, str(e)):
                    raise
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
        if st.fsdp is not None:  # pure FSDP: each buddy's shadow of its ward's shard, from the restored one
            st.fsdp.sync(self.rank, st.optimizer, self._link.collective)
        self._events.record(Event.RESTORED, rank=self.rank, step=step, tier=tier, why=why[:300],
                            generation=self._machine.generation)
        if self.rank == 0:
            print(f"hp: restored step {step} from the {tier} tier ({why})", file=sys.stderr, flush=True)
        return True

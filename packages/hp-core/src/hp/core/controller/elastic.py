"""The elastic job: its world size follows failures, preemptions and capacity.

An :class:`ElasticController` is the job controller of a job started with a scaling policy (``hp run
--nnodes MIN:MAX --scaling-policy FILE``): a :class:`hp.core.controller.Controller` given an
:class:`ElasticPolicy`, which adds the scale events. The decision of each (the target world size) is the
:class:`hp.core.scaling.Scaler`'s; hp-core only acts on it:

- **shrink**: a rank dies and no spare can take it: the job re-forms without it (the survivors abandon
  the step and replay it at the smaller size), while the target stays within the policy; else the
  fixed-size rungs (restart the process, stop the job) as before. Its agent starts a new process in the
  freed slot, which joins as a *joiner* spare (below): the job grows back once it is ready.
- **grow**: ready *joiners* (the processes of a node that joined the running job, or the replacement
  of a dead rank; a node's joiners once all of them are ready) take new ranks after the highest one,
  at the next step boundary (``at_boundary``):
  the ranks finish the step they are in, re-form, and the joiners hydrate from peers.
- **preemption** (``node_leaving``: SIGTERM to an agent): the node's ranks leave at the next step
  boundary and exit 0; never a failure. Where the job cannot go on without the node (below the policy's
  minimum, or the node hosts the controller) the whole job is preempted instead (``JobState.PREEMPTED``):
  every rank saves its last committed step through the job's checkpoint and exits; a restart resumes there.
- **capacity** (``scale``: ``hp scale --replicas N``): the job shrinks to (gracefully, highest ranks
  first) or grows into N ranks.

Every change renumbers ranks stably (:func:`hp.core.scaling.renumber`): processes find their rank in
the plan by their holder id. Pure like the rest of the controller: clock and publish are injected.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from hp.core.controller.book import ControllerConfig, Refused, request_field
from hp.core.controller.dispatch import Controller
from hp.core.controller.policy import RecoveryPolicy
from hp.core.protocol import Decision, FailureAction, JobState, Verb, spare_holder, spare_id
from hp.core.scaling import CAPACITY, FAILURE, PREEMPTION, Scaler, ScaleEvent, renumber


class ElasticPolicy(RecoveryPolicy):
    """The elastic job's decisions: only a ready spare takes a dead rank, a rank none takes shrinks the job,
    a late join brings joiners, a ready joiner grows the job; ``scale`` and ``node_leaving`` are served.
    Its own durable state: the capacity the operator set, and the joiners."""

    kind = "ElasticController"

    def __init__(self, scaler: Scaler) -> None:
        super().__init__()
        self.scaler = scaler
        self.capacity: int | None = None  # ranks the cluster gives the job (None: as many as the policy allows)
        self.joiners: set[str] = set()  # spares waiting to grow the job (not kept in reserve for failures)

    # ---- membership changes ---------------------------------------------------------------------
    def _available(self, world: int) -> int:
        """Ranks the job could run with now: its own plus the ready joiners, within the capacity."""
        spares = self.parts.book.spares
        self.joiners.intersection_update(spares.free)  # promoted in a failure, died, or lost meanwhile
        ready = sum(1 for s in self.joiners if s in spares.ready)
        return min(world + ready, self.capacity if self.capacity is not None else world + ready)

    def _resize(self, leaving: set[int], joining: list[str], why: str, decision: Decision,
                at_boundary: bool, **details: Any) -> None:
        """Re-number the ranks without ``leaving`` and with the spares ``joining``, in one new generation."""
        parts = self.parts
        b = parts.book
        world = len(b.members)
        nodes = [b.spares.take(s) for s in joining]
        self.joiners.difference_update(joining)
        holders, members, moved = renumber(b.holders, b.members, leaving,
                                           [(spare_holder(s), n) for s, n in zip(joining, nodes)])
        b.holders, b.members = holders, members
        b.rank_exceptions = {moved[r]: c for r, c in b.rank_exceptions.items() if r in moved}
        b.rank_restarts = {moved[r]: c for r, c in b.rank_restarts.items() if r in moved}
        parts.journal.log(decision, old_world=world, world_size=len(members), leaving=sorted(leaving),
                          joining=joining, **details)
        parts.lifecycle.bump(why, at_boundary=at_boundary)
        for rank, spare in enumerate(joining, start=len(members) - len(joining)):
            parts.lifecycle.announce(rank, spare, True, None, why)

    def _units_of(self, ranks: Iterable[int]) -> set[int]:
        """``ranks`` and the other ranks of their units. A unit (the policy's ``unit``) is consecutive ranks,
        ``[k * unit, (k + 1) * unit)``: an HSDP shard group, say, whose shards exist only together. Ranks
        leave by whole units, so that the ranks that stay keep their place in a unit (their rank modulo the
        unit) through the stable renumbering: an HSDP rank keeps the shard it holds."""
        units = {r // self.scaler.unit for r in ranks}
        return {r for r in self.parts.book.members if r // self.scaler.unit in units}

    def _leaving(self, going: set[int], target: int) -> set[int]:
        """``going`` (already whole units) and, while the job is above ``target``, its highest other ranks."""
        members = self.parts.book.members
        extra = [r for r in sorted(members, reverse=True) if r not in going][:len(members) - len(going) - target]
        return going | set(extra)

    def _maybe_grow(self) -> None:
        """Ready joiners take new ranks if the policy lets the job grow into them."""
        b = self.parts.book
        if b.state is not JobState.RUNNING or any(b.nodes[n].done for n in b.members.values()):
            return  # ranks that finished the job's last step will form no new generation
        world = len(b.members)
        self._available(world)  # prunes the joiners
        # a node's joiners grow the job together (one re-form, not one per process as each gets ready)
        starting = {b.spares.free[s] for s in self.joiners if s not in b.spares.ready}
        ready = [s for s in b.spares.order() if s in self.joiners and s in b.spares.ready
                 and b.spares.free[s] not in starting]
        if not ready:
            return
        target = self.scaler.target(world, self._available(world), ScaleEvent(CAPACITY))
        if target.world is not None and target.world > world:
            self._resize(set(), ready[:target.world - world], "grow", Decision.GROW, True, reason=target.reason)

    # ---- the decisions that differ (with the lock held) -------------------------------------------
    def pick_spare(self, node_rank: int) -> str | None:
        """Only a ready spare takes a dead rank: waiting for one still starting would hold every rank for
        its imports, while shrinking now and growing into it once ready costs one re-form."""
        spare = super().pick_spare(node_rank)
        return spare if spare in self.parts.book.spares.ready else None

    def without_spare(self, ranks: list[int], cause: str) -> dict | None:
        b = self.parts.book
        world = len(b.members)
        going = self._units_of(ranks)  # a unit larger than one: the dead ranks' unit-mates leave at once too
        target = self.scaler.target(world, self._available(world), ScaleEvent(FAILURE, len(going)))
        if target.world is None or target.world >= world:
            self.parts.journal.log(Decision.ESCALATE, ranks=ranks, reason=target.reason)
            return None
        self._resize(self._leaving(going, target.world), [], "shrink", Decision.SHRINK, False, ranks=ranks,
                     cause=cause, reason=target.reason)
        return {"action": FailureAction.SHRINK, "generation": b.generation, "world_size": len(b.members)}

    def late_join(self, p: dict) -> dict:
        """After the rendezvous, a node joins as spares that grow the job."""
        parts = self.parts
        b = parts.book
        b.require_running()
        node = parts.membership.join_request(p)
        known = b.nodes.get(node.node_rank)
        if known is not None and known.rank_offset == -1 and not (known.done or known.lost) \
                and (known.nproc, known.host, known.spares) == (node.nproc, node.host, node.spares):
            return {"joined": True}  # the same late join again (its first answer was lost)
        if known is not None and not (known.done or known.lost):
            raise Refused(409, f"node_rank {node.node_rank} is already in the job (from {known.host})")
        used = [int(s.rpartition("s")[2]) for s in b.spares.seen if s.startswith(spare_id(node.node_rank, 0)[:-1])]
        base = max(used, default=-1) + 1
        node.rank_offset, node.last_seen = -1, parts.clock()
        node.spare_ids = [spare_id(node.node_rank, base + i) for i in range(node.nproc + node.spares)]
        for i, sid in enumerate(node.spare_ids):
            b.spares.add(sid, node.node_rank)
            if i < node.nproc:
                self.joiners.add(sid)
        b.nodes[node.node_rank] = node
        parts.journal.log(Decision.JOIN, node_rank=node.node_rank, host=node.host, nproc=node.nproc,
                          spares=node.spares, late=True)
        return {"joined": True}

    def spare_added(self, spare: str, p: dict) -> None:
        if p.get("joiner") is True:  # the replacement of a rank the job shrank without
            self.joiners.add(spare)

    def spare_ready(self, spare: str) -> None:
        self._maybe_grow()

    def verbs(self) -> dict[Verb, Callable[[dict], dict]]:
        return {Verb.NODE_LEAVING: self.node_leaving, Verb.SCALE: self.scale}

    def scale(self, p: dict) -> dict:
        """The capacity is ``replicas`` ranks now: shrink to it (highest ranks leave at a step boundary)
        or grow into it (with ready joiners)."""
        b = self.parts.book
        b.require_running()
        replicas = request_field(p, "replicas", int)
        if replicas < 0:
            raise Refused(400, f"replicas must be >= 0, got {replicas}")
        world = len(b.members)
        target = self.scaler.target(world, min(replicas, self._available(world)), ScaleEvent(CAPACITY))
        if target.world is None:
            raise Refused(409, f"cannot scale to {replicas}: {target.reason}")
        self.capacity = replicas
        self.parts.journal.log(Decision.CAPACITY, replicas=replicas, world_size=world)
        if target.world < world:
            leaving = set(sorted(b.members)[target.world:])
            self._resize(leaving, [], "scale", Decision.PREEMPT, True, reason=target.reason)
        else:
            self._maybe_grow()
        return {"generation": b.generation, "world_size": len(b.members), "capacity": replicas}

    def node_leaving(self, p: dict) -> dict:
        """Graceful preemption of a node (its agent got SIGTERM): its ranks leave at the next step boundary.
        Answers ``leave``; or ``save`` when the job cannot go on without the node (below the policy's
        minimum, or the node hosts the controller): the job is preempted and saves its last committed step."""
        parts = self.parts
        b = parts.book
        node = parts.membership.fence(p)
        if b.state is JobState.PREEMPTED:
            return parts.lifecycle.preempt_job(b.reason)  # another node already took the job down: it saves
        b.require_running()
        if p.get("hosts_controller") is True:  # the controller goes with this node: the job cannot go on
            return parts.lifecycle.preempt_job(f"node {node.node_rank}, which hosts the controller, is preempted")
        ranks = self._units_of(r for r, owner in b.members.items() if owner == node.node_rank)
        world = len(b.members)
        if ranks:
            target = self.scaler.target(world, self._available(world) - len(ranks), ScaleEvent(PREEMPTION, len(ranks)))
            if target.world is None:
                return parts.lifecycle.preempt_job(f"node {node.node_rank} is preempted and {target.reason}")
            ranks = self._leaving(ranks, target.world)
        node.done = True  # gone by agreement: never declared lost, never waited for
        dropped = sorted(s for s, owner in b.spares.free.items() if owner == node.node_rank)
        b.spares.drop_nodes({node.node_rank})
        self.joiners.intersection_update(b.spares.free)
        if ranks:
            self._resize(ranks, [], "preempt", Decision.PREEMPT, True, node_rank=node.node_rank)
        self._maybe_grow()  # ready joiners waiting at the maximum take the freed places
        # the agent stops these; a spare of the node promoted since its last heartbeat leaves like its ranks
        return {"action": FailureAction.LEAVE, "generation": b.generation, "world_size": len(b.members),
                "spares": dropped}

    # ---- what it adds to the controller's views -----------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {"world_size": len(self.parts.book.members), "capacity": self.capacity,
                "joiners": sorted(self.joiners), "min_replicas": self.scaler.min_replicas,
                "max_replicas": self.scaler.max_replicas}

    def dump(self) -> dict[str, Any] | None:
        return {"capacity": self.capacity, "joiners": sorted(self.joiners)}

    def load(self, state: dict[str, Any]) -> None:
        self.capacity = state["capacity"]
        self.joiners = set(state["joiners"])


class ElasticController(Controller):
    """The controller of an elastic job: a :class:`Controller` with an :class:`ElasticPolicy` over ``scaler``."""

    def __init__(self, config: ControllerConfig, scaler: Scaler, clock: Callable[[], float] = time.monotonic,
                 publish: Callable[[str, str], None] | None = None,
                 persist: Callable[[dict, list[dict]], None] | None = None) -> None:
        self.elastic = ElasticPolicy(scaler)
        super().__init__(config, clock, publish, persist, policy=self.elastic)

    @property
    def scaler(self) -> Scaler:
        return self.elastic.scaler

    @property
    def capacity(self) -> int | None:
        return self.elastic.capacity

    @property
    def joiners(self) -> set[str]:
        return self.elastic.joiners

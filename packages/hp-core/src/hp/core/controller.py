"""The job controller: membership, generations, fencing and recovery decisions.

Pure state machine: it receives decoded, authenticated requests from agents (see
:mod:`hp.core.control_plane` for the wire) and answers with decisions. Every membership change bumps
the generation; a mutating request that carries an older generation is refused, so an agent that
missed a change can never act on a stale view.

Fencing, verb by verb (every request names its node, which must be a member and not declared lost):

============== ======================================================================================
verb           fenced by
============== ======================================================================================
worker_failed  the current generation and the holder: the reporting process must hold the rank now
rank_failed    the current generation and the holder (the worker's own report)
spare_failed   the current generation (the agent catches up once and asks again)
spare_added    the current generation
node_done      the current generation
node_leaving   the current generation (:class:`hp.core.rescale.ElasticController`)
node_stopping  a generation no newer than the current one: a member node that stops takes its ranks
               with it whatever it has seen, but one that names a generation not made yet is forged
spare_ready    the spare itself: only a free spare of that node moves up the free list, nothing else
heartbeat      none: liveness whatever the agent has seen; the answer carries the current generation
join           the job's state: only during rendezvous (or, elastic, a node not yet a member)
scale          none: the operator sets the desired capacity, not a change relative to a generation
node_failed    the generation the reporter read (``state``): the scheduler (an operator identity, e.g.
               the Slurm base job, hp k8s watch) says a node failed; a node already lost or done is left
               alone, and so is one whose ``incarnation`` (a pod's uid) is not the one the report names
============== ======================================================================================

Durability (the HA controller, :mod:`hp.core.leader`): with a ``persist`` function injected, every
request that changed the job's state is written through it *before* its answer is sent and before
the values it publishes reach the store (they are held in an outbox, itself part of the persisted
state, so a replica that takes over re-publishes what its predecessor may not have). A persist that
fails (the lease was lost) *deposes* this controller: that request and every later one is refused
(503), so a deposed leader never answers a decision it could not make durable. A request that names
a ``rid`` is answered from the node's last answer when it repeats that ``rid``: an agent that retries
against the new leader a request the old one decided gets the same decision, not a refusal.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hp.core.protocol import (
    GENERATION_KEY, Decision, FailureAction, JobState, Plan, SpareAssignment, Verb, plan_key, restarted_holder,
    spare_holder,
    spare_id, spare_key, worker_holder,
)
from hp.core.spares import SparePool

log = logging.getLogger("hp.controller")


MAX_INCARNATION = 128  # characters of a node's incarnation (a pod uid has 36)
ANSWERS_KEPT = 8  # decided requests remembered per node, for a retry at a new leader (see the docstring)


class Refused(Exception):
    """A request the controller will not act on; ``status`` follows HTTP meanings."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


@dataclass
class NodeRecord:
    node_rank: int
    nproc: int
    host: str
    spares: int = 0
    rank_offset: int = 0
    last_seen: float = 0.0
    done: bool = False
    lost: bool = False  # silent past the heartbeat timeout: its ranks went to spares elsewhere
    address: str = ""  # the address the agent reached the controller from (told to survivors)
    spare_ids: list[str] = field(default_factory=list)  # the ids of the spares its agent starts (after rendezvous)
    promotions: list[dict] = field(default_factory=list)  # spares of this node given a rank, not yet told
    forming_store: str = ""  # HOST:PORT of the TCPStore its agent hosts for forming process groups (HA), if any
    incarnation: str = ""  # what the scheduler calls this run of the node (a pod's uid): HP_NODE_INCARNATION


@dataclass
class ControllerConfig:
    nnodes: int
    max_restarts: int = 0  # worker restarts the whole job tolerates, as torchrun counts them
    heartbeat_timeout_s: float = 30.0
    store_host: str = "127.0.0.1"
    store_port: int = 0
    decision_log: str | None = None  # JSON-lines file; None keeps the log in memory only
    max_rank_exceptions: int = 2  # in-process recoveries one rank may cause before it is replaced
    max_nodes: int | None = None  # elastic (``--nnodes MIN:MAX``): node ranks up to this may join later


def describe_exit(exitcode: int | None, signal_name: str | None) -> str:
    if signal_name:
        return f"was killed by {signal_name}"
    return f"exited with code {exitcode}"


def _host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() or c in "/?#@" for c in host)


def request_field(payload: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    value = payload.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise Refused(400, f"malformed request: field {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


def _incarnation(payload: dict) -> str:
    """A request's optional ``incarnation``: printable, at most :data:`MAX_INCARNATION` characters."""
    value = payload.get("incarnation", "")
    if not isinstance(value, str) or len(value) > MAX_INCARNATION or not value.isprintable():
        raise Refused(400, f"malformed request: field 'incarnation' must be a printable str of at most "
                           f"{MAX_INCARNATION} characters")
    return value


class Controller:
    """One per job. Thread-safe: the control server calls it from several threads."""

    def __init__(self, config: ControllerConfig, clock: Callable[[], float] = time.monotonic,
                 publish: Callable[[str, str], None] | None = None,
                 persist: Callable[[dict, list[dict]], None] | None = None) -> None:
        self.config = config
        self._clock = clock
        self._publish_fn = publish
        self._persist_fn = persist  # (state, new decisions): durable before any answer (hp.core.leader)
        self._outbox: list[tuple[str, str]] = []  # values to publish once the state that made them is durable
        self._dirty = False  # the state changed since it was last persisted
        self._persisted = 0  # decisions already persisted
        self.deposed = ""  # why this controller may no longer decide (its lease was lost); "" while it may
        # node_rank -> its last decided requests, newest last: [{"rid", "verb", "answer"}] (its agent's and
        # its workers' interleave: a few are kept)
        self.answers: dict[int, list[dict]] = {}
        self._lock = threading.Lock()
        self.generation = 0
        self.state = JobState.RENDEZVOUS
        self.reason = ""
        self.restarts = 0
        self.finishing = False  # an operator asked the job to end at its next agreed step boundary (hp finish)
        self.nodes: dict[int, NodeRecord] = {}
        self.members: dict[int, int] = {}  # rank -> node_rank currently holding it
        self.holders: dict[int, str] = {}  # rank -> id of the process holding it (fences out old ones)
        self.rank_restarts: dict[int, int] = {}
        self.spares = SparePool()
        self.free_spares = self.spares.free  # spare id -> node_rank (the pool's own dict)
        self.rank_exceptions: dict[int, int] = {}
        self.decisions: list[dict] = []  # made by this controller
        self.decisions_before = 0  # made by the leaders before it (HA: the count of the job's log)
        self._handlers = {
            Verb.JOIN: self._join,
            Verb.RENDEZVOUS: self._rendezvous,
            Verb.HEARTBEAT: self._heartbeat,
            Verb.WORKER_FAILED: self._worker_failed,
            Verb.RANK_FAILED: self._rank_failed,
            Verb.SPARE_FAILED: self._spare_failed,
            Verb.SPARE_ADDED: self._spare_added,
            Verb.SPARE_READY: self._spare_ready,
            Verb.NODE_DONE: self._node_done,
            Verb.NODE_STOPPING: self._node_stopping,
            Verb.NODE_LEAVING: self._not_elastic,  # hp.core.rescale.ElasticController handles these two
            Verb.SCALE: self._not_elastic,
            Verb.NODE_FAILED: self._node_failed,
            Verb.FINISH: self._finish,
            Verb.STATE: lambda p: self.snapshot(),
        }

    # ---- entry points -------------------------------------------------------------------
    def handle(self, verb: str, payload: dict) -> dict:
        """Dispatch one authenticated request; raises :class:`Refused` (and logs it) on refusal."""
        handler = self._handlers.get(verb)
        with self._lock:
            if self.deposed:
                raise Refused(503, f"this controller was deposed ({self.deposed}): ask the current leader")
            try:
                if handler is None:
                    raise Refused(404, f"unknown request {verb!r}")
                repeated = self._repeated(verb, payload)
                if repeated is not None:
                    return repeated
                answer = handler(payload)
                self._remember(verb, payload, answer)
                return answer
            except Refused as r:
                self.record_refusal(verb, r.status, r.message, payload.get("node_rank"))
                raise
            finally:
                self._commit()

    def _repeated(self, verb: str, payload: dict) -> dict | None:
        """The answer already given to this very request (same node, verb and ``rid``), if any."""
        rid, node = payload.get("rid"), payload.get("node_rank")
        if not isinstance(rid, str) or type(node) is not int:
            return None
        return next((a["answer"] for a in self.answers.get(node, ()) if a["rid"] == rid and a["verb"] == verb), None)

    def _remember(self, verb: str, payload: dict, answer: dict) -> None:
        rid, node = payload.get("rid"), payload.get("node_rank")
        if self._dirty and isinstance(rid, str) and type(node) is int and node in self.nodes:
            kept = self.answers.setdefault(node, [])
            kept.append({"rid": rid, "verb": verb, "answer": answer})
            del kept[:-ANSWERS_KEPT]

    def _commit(self, force: bool = False) -> None:
        """Make what the last request changed durable (when persisting), then publish its values. Not
        joins during the rendezvous: they are idempotent and an agent joins again when a new leader does
        not know its node, so persisting the whole state per join (O(nodes^2) bytes) buys nothing; the
        state is persisted when the rendezvous completes. ``force``: persist anyway (a takeover's write,
        which fences out the previous leader)."""
        waits = self.state is JobState.RENDEZVOUS and not self._outbox and not force
        if self._dirty and self._persist_fn is not None and not waits:
            from hp.core.controller_state import dump  # the state's shape lives there

            try:
                self._persist_fn(dump(self, self._outbox), self.decisions[self._persisted:])
            except Exception as e:  # lost the lease (or the store): nothing of this request may take effect
                self.deposed = str(e) or type(e).__name__
                self._outbox.clear()
                log.error("controller deposed: %s", self.deposed)
                raise Refused(503, f"this controller was deposed ({self.deposed}): ask the current leader") from None
            self._persisted = len(self.decisions)
        self._dirty = False
        outbox, self._outbox = self._outbox, []
        if self._publish_fn is not None:
            for key, value in outbox:
                self._publish_fn(key, value)

    @property
    def decision_count(self) -> int:
        """Decisions made in this job, by every leader so far."""
        return self.decisions_before + len(self.decisions)

    def take_over(self, state: dict | None, **details: Any) -> None:
        """An HA replica was elected (:mod:`hp.core.leader`): ``state`` is the last one its predecessor
        persisted (None: the job is new). Logs the election and persists under the new lease; the values
        of the last decision are published again (its leader may have died before it could)."""
        from hp.core.controller_state import load

        with self._lock:
            if state is not None:
                self._outbox = load(self, state, self._clock())
            self._log(Decision.CONTROLLER_ELECTED, **details)
            self._commit(force=True)

    def record_refusal(self, verb: str, status: int, message: str, node_rank: Any = None) -> None:
        log.warning("refused %s from node %s: %s", verb, node_rank, message)
        self._log(Decision.REFUSED, request=verb, status=status, reason=message, node_rank=node_rank)

    def check_liveness(self) -> None:
        """Nodes silent past the heartbeat timeout are lost together: every rank they held goes to a
        free spare on a surviving node, in one new generation; without enough spares the job fails,
        naming the nodes. (A lost node's agent fences itself before this: see hp.core.agent.)"""
        with self._lock:
            if self.state is not JobState.RUNNING or self.deposed:
                return
            now = self._clock()
            lost = [n for n in self.nodes.values()
                    if not n.done and not n.lost and now - n.last_seen > self.config.heartbeat_timeout_s]
            if lost:
                try:
                    self._lose_nodes(lost, now)
                finally:
                    try:
                        self._commit()
                    except Refused:
                        pass  # deposed: the new leader decides about these nodes

    def _node_failed(self, p: dict) -> dict:
        """The scheduler says node ``node`` failed: it is lost now, as a silent one is once the heartbeat
        timeout has passed (its ranks go to spares, or an elastic job shrinks without them)."""
        self._require_running()
        node_rank, generation = request_field(p, "node", int), request_field(p, "generation", int)
        if generation != self.generation:
            raise Refused(409, f"stale generation {generation} (current is {self.generation})")
        node = self.nodes.get(node_rank)
        if node is None:
            raise Refused(404, f"node {node_rank} is not in the job")
        reason = p.get("reason") if isinstance(p.get("reason"), str) else "the scheduler"
        incarnation = _incarnation(p)
        if node.lost or node.done:
            return {"lost": False, "generation": self.generation}
        if incarnation and incarnation != node.incarnation:  # about an earlier run of that node rank
            return {"lost": False, "generation": self.generation, "incarnation": node.incarnation}
        self._lose_nodes([node], self._clock(), cause=f"failed ({reason[:200]})")
        return {"lost": True, "generation": self.generation}

    def _lose_nodes(self, lost: list[NodeRecord], now: float, cause: str | None = None) -> None:
        """``cause``: what the job's failure names (default: the silence)."""
        names = ", ".join(f"node {n.node_rank} ({n.host}{' ' + n.address if n.address else ''})" for n in lost)
        silent = max(now - n.last_seen for n in lost)
        cause = cause or f"no heartbeat for {silent:.1f} s"
        gone = {n.node_rank for n in lost}
        for node in lost:
            node.lost = True
            self._log(Decision.NODE_LOST, node_rank=node.node_rank, host=node.host, address=node.address,
                      silent_s=round(now - node.last_seen, 3), cause=cause)
        self.spares.drop_nodes(gone)
        ranks = sorted(r for r, owner in self.members.items() if owner in gone)
        if not ranks:
            return  # only spares were there: nobody's group changed
        spares = self.spares.order()
        if len(spares) < len(ranks):
            if self._without_spare(ranks, f"{names} lost") is None:
                self._fail(f"{names} lost: {cause}; its ranks {ranks} need {len(ranks)} "
                           f"spare(s) on the surviving nodes, {len(spares)} free")
            return
        moves = [(rank, spare, self._give(rank, spare)) for rank, spare in zip(ranks, spares)]
        self._bump("node_lost", nodes=sorted(gone), ranks=ranks)
        for rank, spare, ready in moves:
            self._announce(rank, spare, ready, None, f"{names} lost")

    def snapshot(self) -> dict:
        return {
            "state": self.state.value,
            "generation": self.generation,
            "reason": self.reason,
            "restarts": self.restarts,
            "finishing": self.finishing,
            "members": dict(self.members),
            "free_spares": sorted(self.free_spares),
            "ready_spares": sorted(self.spares.ready),
            "nodes": {n.node_rank: {"host": n.host, "nproc": n.nproc, "done": n.done, "lost": n.lost,
                                    "incarnation": n.incarnation}
                      for n in self.nodes.values()},
            "decisions": self.decision_count,
        }

    # ---- decisions ----------------------------------------------------------------------
    def _log(self, decision: Decision, **details: Any) -> None:
        entry = {"t": time.time(), "generation": self.generation, "decision": decision, **details}
        self.decisions.append(entry)
        self._dirty = self._dirty or decision is not Decision.REFUSED  # a refusal changes nothing
        if self.config.decision_log:
            with open(self.config.decision_log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _bump(self, why: str, at_boundary: bool = False, **details: Any) -> None:
        self.generation += 1
        self._log(Decision.NEW_GENERATION, why=why, world_size=len(self.members), **details)
        self._publish_generation(why, at_boundary)

    def _publish_generation(self, why: str, at_boundary: bool) -> None:
        """Tell every worker through the store: the plan of the new generation first, then its
        number, so a worker that sees the number can always read the plan."""
        plan = Plan(self.generation, len(self.members), self.state.value, self.reason, dict(self.holders), why,
                    at_boundary, self._forming_store(), self.finishing)
        self._publish(plan_key(self.generation), plan.to_json())
        self._publish(GENERATION_KEY, str(self.generation))

    def _forming_store(self) -> str:
        """Where this generation's group forms: the store of the first live node holding a rank that hosts
        one (never a rank's, and a different node's once that one is lost); "": the job's store."""
        holding = sorted(set(self.members.values()))
        return next((self.nodes[n].forming_store for n in holding
                     if n in self.nodes and not self.nodes[n].lost and self.nodes[n].forming_store), "")

    def _publish(self, key: str, value: str) -> None:
        """Queue ``key = value`` for the store; :meth:`_commit` sends it once the decision is durable."""
        self._outbox.append((key, value))
        self._dirty = True

    def _fail(self, reason: str) -> None:
        # Ending the job is the last membership change: workers waiting for a new generation
        # read its plan and stop.
        self.state, self.reason = JobState.FAILED, reason
        self._log(Decision.FAIL_JOB, reason=reason)
        self._bump("job_failed")

    def _preempt_job(self, reason: str) -> dict:
        """The job cannot go on without a node that is leaving: every rank saves its last committed step
        (the tiered-checkpoint rung) and exits (a failure generation: ranks abandon the step they are in,
        so the save fits in a grace period shorter than a step). Idempotent: every preempted node asks."""
        if self.state is JobState.RUNNING:
            self.state, self.reason = JobState.PREEMPTED, reason
            self._log(Decision.PREEMPT_JOB, reason=reason)
            self._bump("preempted")
        return {"action": FailureAction.SAVE, "generation": self.generation, "reason": self.reason}

    def _fence(self, payload: dict) -> NodeRecord:
        generation = request_field(payload, "generation", int)
        node = self._node(payload)
        if generation != self.generation:
            raise Refused(
                409,
                f"stale generation {generation} (current is {self.generation})"
                if generation < self.generation
                else f"unknown future generation {generation} (current is {self.generation})",
                generation=self.generation,
            )
        return node

    def _node(self, payload: dict) -> NodeRecord:
        node_rank = request_field(payload, "node_rank", int)
        if node_rank not in self.nodes:
            raise Refused(403, f"node {node_rank} is not a member of this job")
        node = self.nodes[node_rank]
        if node.lost:  # it was silent too long: its ranks belong to other processes now
            raise Refused(410, f"node {node_rank} was declared lost (no heartbeat for "
                               f"{self.config.heartbeat_timeout_s:g} s); its ranks were given to other nodes")
        return node

    def _require_running(self) -> None:
        if self.state is not JobState.RUNNING:
            raise Refused(409, f"job is {self.state.value}", state=self.state.value, reason=self.reason)

    # ---- handlers (called with the lock held) -------------------------------------------
    def _join(self, p: dict) -> dict:
        node = self._join_request(p)
        known = self.nodes.get(node.node_rank)
        if self.state is not JobState.RENDEZVOUS:
            raise Refused(409, f"job is {self.state.value}; node {node.node_rank} cannot join now")
        if known and (known.nproc, known.host, known.spares) != (node.nproc, node.host, node.spares):
            raise Refused(409, f"node_rank {node.node_rank} already joined from {known.host}")
        self.nodes[node.node_rank] = node
        self._log(Decision.JOIN, node_rank=node.node_rank, host=node.host, nproc=node.nproc, spares=node.spares)
        if len(self.nodes) == self.config.nnodes:
            offset = 0
            for node in (self.nodes[n] for n in sorted(self.nodes)):
                node.rank_offset = offset
                node.last_seen = self._clock()
                self.members.update({r: node.node_rank for r in range(offset, offset + node.nproc)})
                self.holders.update({r: worker_holder(r, 0) for r in range(offset, offset + node.nproc)})
                node.spare_ids = [spare_id(node.node_rank, i) for i in range(node.spares)]
                for sid in node.spare_ids:
                    self.spares.add(sid, node.node_rank)
                offset += node.nproc
            self.state = JobState.RUNNING
            self._bump("rendezvous_complete")
        return {"joined": True}

    def _join_request(self, p: dict) -> NodeRecord:
        """The node a ``join`` describes, its fields checked."""
        node_rank = request_field(p, "node_rank", int)
        nproc = request_field(p, "nproc", int)
        host = request_field(p, "host", str)
        spares, address, forming = p.get("spares", 0), p.get("address", ""), p.get("forming_store", "")
        incarnation = _incarnation(p)
        if not isinstance(address, str):
            raise Refused(400, "malformed request: field 'address' must be str")
        if not isinstance(forming, str) or (forming and not _host_port(forming)):
            raise Refused(400, "malformed request: field 'forming_store' must be HOST:PORT")
        if not isinstance(spares, int) or isinstance(spares, bool) or spares < 0:
            raise Refused(400, "malformed request: field 'spares' must be an int >= 0")
        limit = max(self.config.nnodes, self.config.max_nodes or 0)
        if not 0 <= node_rank < limit:
            raise Refused(400, f"node_rank {node_rank} outside [0, {limit})")
        if nproc < 1:
            raise Refused(400, f"nproc must be >= 1, got {nproc}")
        return NodeRecord(node_rank, nproc, host, spares, address=address, forming_store=forming,
                          incarnation=incarnation)

    def _rendezvous(self, p: dict) -> dict:
        node = self._node(p)
        if self.state is JobState.RENDEZVOUS:
            return {"state": self.state.value, "joined": len(self.nodes), "nnodes": self.config.nnodes}
        node.last_seen = self._clock()
        return {
            "state": self.state.value,
            "reason": self.reason,
            "generation": self.generation,
            "world_size": len(self.members),
            "rank_offset": node.rank_offset,  # -1: a node that joined a running job; its processes are spares
            "spare_ids": node.spare_ids,
            "nnodes": self.config.nnodes,
            "store_host": self.config.store_host,
            "store_port": self.config.store_port,
        }

    def _heartbeat(self, p: dict) -> dict:
        # Liveness is accepted whatever generation the agent has seen; the reply carries the
        # current one so the agent catches up before its next (fenced) report.
        node = self._node(p)
        request_field(p, "generation", int)
        node.last_seen = self._clock()
        promotions, node.promotions = node.promotions, []
        self._dirty = self._dirty or bool(promotions)  # told once: a new leader must not tell them again
        ranks = {self.holders[r]: r for r, owner in self.members.items() if owner == node.node_rank}
        answer = {"state": self.state.value, "generation": self.generation, "reason": self.reason,
                  "promotions": promotions, "ranks": ranks, "lost": sorted(n.address for n in self.nodes.values() if n.lost and n.address)}
        if self.state is JobState.PREEMPTED:  # the controller's node stops once every node's ranks saved
            answer["finished"] = self._finished()
        return answer

    def _held_rank(self, p: dict, node: NodeRecord) -> int:
        """The rank a failure report is about, fenced by holder: the reporting process (``holder``) must
        be the one holding it now; an older holder (a restarted or replaced process) acts on nothing."""
        holder = request_field(p, "holder", str)
        rank = self._member_rank(p, node)
        if holder != self.holders[rank]:
            raise Refused(409, f"stale holder {holder!r} of rank {rank} (now {self.holders[rank]!r})",
                          generation=self.generation)
        return rank

    def _member_rank(self, p: dict, node: NodeRecord) -> int:
        """The rank a request is about: the one its ``holder`` holds when given (ranks are renumbered by
        scale events, a process's holder id never changes), else ``rank``."""
        holder = p.get("holder")
        rank = next((r for r, h in self.holders.items() if h == holder), None) if isinstance(holder, str) else None
        if rank is None:
            rank = request_field(p, "rank", int)
        if self.members.get(rank) != node.node_rank:
            raise Refused(403, f"rank {rank} is not held by node {node.node_rank}")
        return rank

    def _worker_failed(self, p: dict) -> dict:
        """A worker process died. Its rank goes to a free spare (this node's first), else the
        process is restarted within the budget, else the job stops."""
        node = self._fence(p)
        self._require_running()
        rank = self._held_rank(p, node)
        exitcode, signal_name = p.get("exitcode"), p.get("signal")
        who = f"rank {rank} (node {node.node_rank}, pid {p.get('pid')})"
        cause = describe_exit(exitcode, signal_name if isinstance(signal_name, str) else None)
        spare = self._pick_spare(node.node_rank)
        if spare is None and (answer := self._without_spare([rank], cause)) is not None:
            return answer
        if spare is not None:
            ready = self._give(rank, spare)
            self._bump("spare_promoted", rank=rank, spare=spare, cause=cause)
            promotion = self._announce(rank, spare, ready, node.node_rank, cause)
            if self.members[rank] == node.node_rank:
                return {"action": FailureAction.PROMOTE_SPARE, **promotion}
            return {"action": FailureAction.MOVED, "rank": rank, "node": self.members[rank],
                    "generation": self.generation}
        if self.restarts < self.config.max_restarts:
            self.restarts += 1
            self.rank_restarts[rank] = self.rank_restarts.get(rank, 0) + 1
            self.holders[rank] = restarted_holder(self.holders[rank])
            self._bump("worker_restart", rank=rank, cause=cause)
            self._log(Decision.RESTART_WORKER, rank=rank, node_rank=node.node_rank, cause=cause, restarts=self.restarts)
            return {"action": FailureAction.RESTART, "generation": self.generation, "rank": rank,
                    "holder": self.holders[rank]}
        message = p.get("message")
        detail = f": {message}" if isinstance(message, str) and message else ""
        spent = f"restarts exhausted ({self.restarts}/{self.config.max_restarts})"
        if self.spares.seen:
            spent = f"no spare left ({len(self.spares.seen)} started) and {spent}"
        self._fail(f"{who} {cause}{detail}; {spent}")
        return {"action": FailureAction.STOP, "reason": self.reason, "generation": self.generation}

    def _pick_spare(self, node_rank: int) -> str | None:
        """The spare that takes a dead rank of ``node_rank`` (None: none can)."""
        return self.spares.pick(node_rank)

    def _without_spare(self, ranks: list[int], cause: str) -> dict | None:
        """``ranks`` died and no spare can take them: an elastic controller shrinks the job instead (its
        answer); None: the fixed-size rungs (restart the process, else stop the job)."""
        return None

    def _give(self, rank: int, spare: str) -> bool:
        """Hand ``rank`` to a free spare (before the generation bump); returns whether it was ready."""
        ready = spare in self.spares.ready
        self.members[rank] = self.spares.take(spare)
        self.holders[rank] = spare_holder(spare)
        return ready

    def _announce(self, rank: int, spare: str, ready: bool, failed_node: int | None, cause: str) -> dict:
        """After the bump: log the promotion, tell the spare its rank through the store, and queue it
        for the spare's agent unless that agent reported the failure (it hears the answer)."""
        owner = self.members[rank]
        self._log(Decision.PROMOTE_SPARE, rank=rank, spare=spare, spare_node=owner, failed_node=failed_node,
                  cause=cause, ready=ready)
        promotion = {"spare": spare, "rank": rank, "generation": self.generation}
        self._publish(spare_key(spare), SpareAssignment(rank, self.generation).to_json())
        if owner != failed_node:
            self.nodes[owner].promotions.append(promotion)
        return promotion

    def _rank_failed(self, p: dict) -> dict:
        """A worker recovered in process from a failure of its own step (an exception, a
        collective error nobody explained): same membership, new generation. A rank that keeps
        failing is told to exit, so that its process is replaced."""
        node = self._fence(p)
        self._require_running()
        rank = self._held_rank(p, node)
        reason = p.get("reason") if isinstance(p.get("reason"), str) else "failure"
        if reason == "unrecoverable":  # state no peer can rebuild: in-process recovery is over
            message = p.get("message") if isinstance(p.get("message"), str) else "state lost"
            self._fail(f"rank {rank} cannot recover in process: {message}")
            return {"action": FailureAction.STOP, "reason": self.reason, "generation": self.generation}
        # only a rank's own exceptions count against it: a collective error names no culprit
        count = self.rank_exceptions.get(rank, 0) + (reason == "exception")
        self.rank_exceptions[rank] = count
        if count > self.config.max_rank_exceptions:
            self._log(Decision.ESCALATE, rank=rank, reason=reason, failures=count)
            return {"action": FailureAction.EXIT, "generation": self.generation,
                    "reason": f"rank {rank} failed in process {count} times"}
        self._bump("in_process_recovery", rank=rank, reason=reason)
        return {"action": FailureAction.REFORM, "generation": self.generation}

    def _spare_failed(self, p: dict) -> dict:
        """A spare process died. One given a rank since its agent's last heartbeat is a dead rank: answered
        as ``worker_failed`` (its agent acts on the decision); a free one is only struck off."""
        node = self._fence(p)
        spare = request_field(p, "spare", str)
        holder = spare_holder(spare)
        rank = next((r for r, h in self.holders.items() if h == holder), None)
        if rank is not None and self.members.get(rank) == node.node_rank and self.state is JobState.RUNNING:
            return {"rank": rank, **self._worker_failed({**p, "rank": rank, "holder": holder,
                                                         "generation": self.generation})}
        if self.free_spares.get(spare) == node.node_rank:
            self.spares.take(spare)
            self._log(Decision.SPARE_LOST, spare=spare, node_rank=node.node_rank)
        return {"free_spares": len(self.free_spares)}

    def _spare_added(self, p: dict) -> dict:
        """An agent started a new hot spare (replacing a promoted one): it is free for any rank."""
        node = self._fence(p)
        self._require_running()
        spare = request_field(p, "spare", str)
        if (problem := self.spares.invalid_new(spare, node.node_rank)) is not None:
            raise Refused(*problem)
        self.spares.add(spare, node.node_rank)
        self._log(Decision.SPARE_ADDED, spare=spare, node_rank=node.node_rank)
        return {"free_spares": len(self.free_spares)}

    def _spare_ready(self, p: dict) -> dict:
        """A spare finished starting (sent by the spare itself): it goes before spares still starting.
        One promoted meanwhile, or lost, is answered ``ready: false`` and changes nothing."""
        node = self._node(p)
        spare = request_field(p, "spare", str)
        ready = self.spares.mark_ready(spare, node.node_rank)
        if ready:
            self._log(Decision.SPARE_READY, spare=spare, node_rank=node.node_rank)
        return {"ready": ready}

    def _node_done(self, p: dict) -> dict:
        node = self._fence(p)
        node.done = True
        self._log(Decision.NODE_DONE, node_rank=node.node_rank)
        if self.state is JobState.RUNNING and self._finished():
            self.state = JobState.SUCCEEDED
            self._log(Decision.JOB_SUCCEEDED)
        return {"state": self.state.value}

    def _finish(self, p: dict) -> dict:
        """An operator ends the job (``hp finish``): a planned generation of the same membership whose plan,
        and every later one, says ``finishing``. The ranks end their training loop after the next step whose
        commit vote says one of them has seen it (all after the same step: the vote is a collective), exit
        as at their last step, and the job succeeds as it does then. Asked again: the same answer."""
        self._require_running()
        if not self.finishing:
            self.finishing = True
            reason = p.get("reason") if isinstance(p.get("reason"), str) else "an operator"
            self._log(Decision.FINISH, reason=reason[:200])
            self._bump("finish", at_boundary=True)
        return {"finishing": True, "generation": self.generation}

    def _finished(self) -> bool:
        """Whether every rank's work is done: each node holding a rank finished (or was lost)."""
        holding = set(self.members.values()) or set(self.nodes)
        return all(self.nodes[n].done or self.nodes[n].lost for n in holding)

    def _not_elastic(self, p: dict) -> dict:
        raise Refused(409, "this job has a fixed size: start it with `hp run --nnodes MIN:MAX --scaling-policy FILE` "
                           "to scale it")

    def _node_stopping(self, p: dict) -> dict:
        node = self._node(p)
        generation = request_field(p, "generation", int)
        if generation > self.generation:
            raise Refused(409, f"unknown future generation {generation} (current is {self.generation})",
                          generation=self.generation)
        why = p.get("reason") if isinstance(p.get("reason"), str) else "stopping"
        if self.state in (JobState.RUNNING, JobState.RENDEZVOUS):
            self._fail(f"node {node.node_rank} stopped: {why}")
        return {"state": self.state.value}

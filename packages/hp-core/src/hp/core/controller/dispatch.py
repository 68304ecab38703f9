"""The controller's front: one lock, the verb → handler table, and the views of the job.

It owns no decision: each verb is served by the part that owns its idea (membership, liveness,
recovery, the job's lifecycle, or the recovery policy's own verbs), and every request goes through the
journal first (a repeated request gets its remembered answer) and last (what it changed is made
durable, then published). The job's state itself is the :class:`hp.core.controller.book.JobBook` the
parts share; its fields are readable here for the control plane, the agent and the tests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from hp.core.controller.book import ControllerConfig, JobBook, Refused
from hp.core.controller.journal import Journal
from hp.core.controller.lifecycle import Lifecycle
from hp.core.controller.liveness import Liveness
from hp.core.controller.membership import Membership
from hp.core.controller.policy import Parts, RecoveryPolicy
from hp.core.controller.recovery import Recovery
from hp.core.controller.state import dump, load
from hp.core.protocol import Decision, JobState, Verb

log = logging.getLogger("hp.controller")


def _book_field(name: str, doc: str = "") -> property:
    return property(lambda self: getattr(self.book, name), doc=doc or f"The job's ``{name}`` (its book's).")


class Controller:
    """One per job. Thread-safe: the control server calls it from several threads. ``policy``: the
    decisions that differ between fixed-size and elastic jobs (default: a fixed size)."""

    def __init__(self, config: ControllerConfig, clock: Callable[[], float] = time.monotonic,
                 publish: Callable[[str, str], None] | None = None,
                 persist: Callable[[dict, list[dict]], None] | None = None,
                 policy: RecoveryPolicy | None = None) -> None:
        self.config = config
        self.clock = clock
        self.policy = policy if policy is not None else RecoveryPolicy()
        self.book = JobBook(config)
        self.journal = Journal(self.book, lambda outbox: dump(self, outbox), publish, persist)
        self.lifecycle = Lifecycle(self.book, self.journal)
        self.membership = Membership(self.book, self.journal, self.lifecycle, clock, self.policy.late_join)
        self.recovery = Recovery(self.book, self.journal, self.lifecycle, self.membership, self.policy)
        self.liveness = Liveness(self.book, self.journal, self.membership, self.recovery, clock)
        self.policy.bind(Parts(self.book, self.journal, self.lifecycle, self.membership, clock))
        self._lock = threading.Lock()
        m, r = self.membership, self.recovery
        self._handlers: dict[Verb, Callable[[dict], dict]] = {
            Verb.JOIN: m.join, Verb.RENDEZVOUS: m.rendezvous, Verb.HEARTBEAT: self.liveness.heartbeat,
            Verb.WORKER_FAILED: r.worker_failed, Verb.RANK_FAILED: r.rank_failed, Verb.SPARE_FAILED: r.spare_failed,
            Verb.SPARE_ADDED: r.spare_added, Verb.SPARE_READY: r.spare_ready, Verb.NODE_DONE: m.node_done,
            Verb.NODE_STOPPING: m.node_stopping, Verb.NODE_FAILED: self.liveness.node_failed,
            Verb.FINISH: self.lifecycle.finish, Verb.STATE: lambda p: self.snapshot(),
            **self.policy.verbs(),  # the fixed size's refusals of node_leaving and scale, or the elastic answers
        }

    # ---- entry points -------------------------------------------------------------------
    def handle(self, verb: str, payload: dict) -> dict:
        """Dispatch one authenticated request; raises :class:`Refused` (and logs it) on refusal."""
        handler = self._handlers.get(verb)
        with self._lock:
            self.journal.refuse_if_deposed()
            try:
                if handler is None:
                    raise Refused(404, f"unknown request {verb!r}")
                repeated = self.journal.repeated(verb, payload)
                if repeated is not None:
                    return repeated
                answer = handler(payload)
                self.journal.remember(verb, payload, answer)
                return answer
            except Refused as r:
                self.record_refusal(verb, r.status, r.message, payload.get("node_rank"))
                raise
            finally:
                self.journal.commit()

    def take_over(self, state: dict | None, **details: Any) -> None:
        """An HA replica was elected (:mod:`hp.core.leader`): ``state`` is the last one its predecessor
        persisted (None: the job is new). Logs the election and persists under the new lease; the values
        of the last decision are published again (its leader may have died before it could)."""
        with self._lock:
            if state is not None:
                self.journal.outbox = load(self, state, self.clock())
            self.journal.log(Decision.CONTROLLER_ELECTED, **details)
            self.journal.commit(force=True)

    def record_refusal(self, verb: str, status: int, message: str, node_rank: Any = None) -> None:
        log.warning("refused %s from node %s: %s", verb, node_rank, message)
        self.journal.log(Decision.REFUSED, request=verb, status=status, reason=message, node_rank=node_rank)

    def check_liveness(self) -> None:
        """Nodes silent past the heartbeat timeout are lost together: every rank they held goes to a
        free spare on a surviving node, in one new generation; without enough spares the job fails,
        naming the nodes. (A lost node's agent fences itself before this: see hp.core.agent.)"""
        with self._lock:
            if self.book.state is not JobState.RUNNING or self.journal.deposed:
                return
            lost, now = self.liveness.silent()
            if lost:
                try:
                    self.liveness.lose_nodes(lost, now)
                finally:
                    try:
                        self.journal.commit()
                    except Refused:
                        pass  # deposed: the new leader decides about these nodes

    def snapshot(self) -> dict:
        b = self.book
        return {
            "state": b.state.value,
            "generation": b.generation,
            "reason": b.reason,
            "restarts": b.restarts,
            "finishing": b.finishing,
            "members": dict(b.members),
            "free_spares": sorted(b.spares.free),
            "ready_spares": sorted(b.spares.ready),
            "nodes": {n.node_rank: {"host": n.host, "nproc": n.nproc, "done": n.done, "lost": n.lost,
                                    "incarnation": n.incarnation}
                      for n in b.nodes.values()},
            "decisions": self.decision_count,
            **self.policy.snapshot(),
        }

    # ---- views (the job's state lives in its book and journal) ------------------------------------
    generation, state, reason = _book_field("generation"), _book_field("state"), _book_field("reason")
    restarts, finishing, nodes = _book_field("restarts"), _book_field("finishing"), _book_field("nodes")
    members = _book_field("members", "rank -> node_rank currently holding it")
    holders = _book_field("holders", "rank -> id of the process holding it")
    rank_restarts, rank_exceptions = _book_field("rank_restarts"), _book_field("rank_exceptions")
    spares = _book_field("spares")
    free_spares = property(lambda self: self.book.spares.free, doc="spare id -> node_rank, waiting for a rank")
    decisions = property(lambda self: self.journal.decisions, doc="the decisions this controller made")
    decision_count = property(lambda self: self.journal.decision_count, doc="the job's decisions, by every leader")
    answers = property(lambda self: self.journal.answers, doc="node_rank -> its last decided requests")

    @property
    def deposed(self) -> str:
        """Why this controller may no longer decide (its lease was lost); "" while it may."""
        return self.journal.deposed

    @deposed.setter
    def deposed(self, why: str) -> None:  # hp.core.leader: its lease expired, or its replica stopped
        self.journal.deposed = why

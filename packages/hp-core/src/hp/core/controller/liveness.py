"""Liveness: heartbeats, the silence that makes a node lost, and the scheduler's word that one failed.

A heartbeat is accepted whatever generation its agent has seen (the answer carries the current one, so
the agent catches up before its next fenced report) and hands the agent the promotions of its spares
it has not been told yet. Nodes silent past the heartbeat timeout are lost together; so is a node the
scheduler (an operator identity: the Slurm base job, ``hp k8s watch``) says failed, unless the report
is about an earlier run of that node rank. What happens to a lost node's ranks is recovery's
(:meth:`hp.core.controller.recovery.Recovery.nodes_lost`).
"""

from __future__ import annotations

from typing import Callable

from hp.core.controller.book import JobBook, NodeRecord, Refused, incarnation_field, request_field, text_field
from hp.core.controller.journal import Journal
from hp.core.controller.membership import Membership
from hp.core.controller.recovery import Recovery
from hp.core.protocol import Decision, JobState


class Liveness:
    def __init__(self, book: JobBook, journal: Journal, membership: Membership, recovery: Recovery,
                 clock: Callable[[], float]) -> None:
        self.book, self.journal, self.membership, self.recovery, self.clock = book, journal, membership, recovery, clock

    def silent(self) -> tuple[list[NodeRecord], float]:
        """The nodes silent past the heartbeat timeout (not done, not lost yet), and the clock's reading."""
        now = self.clock()
        timeout = self.book.config.heartbeat_timeout_s
        return [n for n in self.book.nodes.values() if not n.done and not n.lost and now - n.last_seen > timeout], now

    def lose_nodes(self, lost: list[NodeRecord], now: float, cause: str | None = None) -> None:
        """``cause``: what the job's failure names (default: the silence)."""
        names = ", ".join(f"node {n.node_rank} ({n.host}{' ' + n.address if n.address else ''})" for n in lost)
        silent = max(now - n.last_seen for n in lost)
        cause = cause or f"no heartbeat for {silent:.1f} s"
        gone = {n.node_rank for n in lost}
        for node in lost:
            node.lost = True
            self.journal.log(Decision.NODE_LOST, node_rank=node.node_rank, host=node.host, address=node.address,
                             silent_s=round(now - node.last_seen, 3), cause=cause)
        self.book.spares.drop_nodes(gone)
        self.recovery.nodes_lost(gone, names, cause)

    # ---- handlers (with the lock held) -------------------------------------------------------------
    def heartbeat(self, p: dict) -> dict:
        # Liveness is accepted whatever generation the agent has seen; the reply carries the
        # current one so the agent catches up before its next (fenced) report.
        b = self.book
        node = self.membership.node(p)
        request_field(p, "generation", int)
        node.last_seen = self.clock()
        promotions, node.promotions = node.promotions, []
        if promotions:  # told once: a new leader must not tell them again
            self.journal.changed()
        ranks = {b.holders[r]: r for r, owner in b.members.items() if owner == node.node_rank}
        answer = {"state": b.state.value, "generation": b.generation, "reason": b.reason,
                  "promotions": promotions, "ranks": ranks,
                  "lost": sorted(n.address for n in b.nodes.values() if n.lost and n.address)}
        if b.state is JobState.PREEMPTED:  # the controller's node stops once every node's ranks saved
            answer["finished"] = b.finished()
        return answer

    def node_failed(self, p: dict) -> dict:
        """The scheduler says node ``node`` failed: it is lost now, as a silent one is once the heartbeat
        timeout has passed (its ranks go to spares, or an elastic job shrinks without them)."""
        b = self.book
        b.require_running()
        node_rank, generation = request_field(p, "node", int), request_field(p, "generation", int)
        if generation != b.generation:
            raise Refused(409, f"stale generation {generation} (current is {b.generation})")
        node = b.nodes.get(node_rank)
        if node is None:
            raise Refused(404, f"node {node_rank} is not in the job")
        reason = text_field(p, "reason", "the scheduler")
        incarnation = incarnation_field(p)
        if node.lost or node.done:
            return {"lost": False, "generation": b.generation}
        if incarnation and incarnation != node.incarnation:  # about an earlier run of that node rank
            return {"lost": False, "generation": b.generation, "incarnation": node.incarnation}
        self.lose_nodes([node], self.clock(), cause=f"failed ({reason[:200]})")
        return {"lost": True, "generation": b.generation}

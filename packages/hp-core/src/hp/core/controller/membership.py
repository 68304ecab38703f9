"""Membership: which nodes are in the job, the rendezvous that gives them ranks, and fencing.

Every request names its node, which must be a member and not declared lost; a mutating one also names
the generation its sender has seen, and one that carries another generation is refused, so an agent
that missed a change can never act on a stale view. A failure report is fenced by holder as well: the
process reporting must hold the rank now, so a restarted or replaced process acts on nothing. Which
verb is fenced how is in :mod:`hp.core.controller`'s table.

A join after the rendezvous is the recovery policy's to answer
(:meth:`hp.core.controller.policy.RecoveryPolicy.late_join`): refused in a fixed-size job, spares that
grow an elastic one.
"""

from __future__ import annotations

from typing import Callable

from hp.core.controller.book import (
    JobBook, NodeRecord, Refused, host_port, incarnation_field, request_field, text_field,
)
from hp.core.controller.journal import Journal
from hp.core.controller.lifecycle import Lifecycle
from hp.core.protocol import Decision, JobState, spare_id, worker_holder


class Membership:
    """``late_join``: the answer to a join after the rendezvous (the recovery policy's)."""

    def __init__(self, book: JobBook, journal: Journal, lifecycle: Lifecycle, clock: Callable[[], float],
                 late_join: Callable[[dict], dict]) -> None:
        self.book, self.journal, self.lifecycle, self.clock = book, journal, lifecycle, clock
        self.late_join = late_join

    # ---- fencing ---------------------------------------------------------------------------------
    def fence(self, payload: dict) -> NodeRecord:
        """The requesting node, which must have seen the current generation."""
        generation = request_field(payload, "generation", int)
        node = self.node(payload)
        current = self.book.generation
        if generation != current:
            raise Refused(
                409,
                f"stale generation {generation} (current is {current})"
                if generation < current
                else f"unknown future generation {generation} (current is {current})",
                generation=current,
            )
        return node

    def node(self, payload: dict) -> NodeRecord:
        """The requesting node: a member, not declared lost."""
        node_rank = request_field(payload, "node_rank", int)
        if node_rank not in self.book.nodes:
            raise Refused(403, f"node {node_rank} is not a member of this job")
        node = self.book.nodes[node_rank]
        if node.lost:  # it was silent too long: its ranks belong to other processes now
            raise Refused(410, f"node {node_rank} was declared lost (no heartbeat for "
                               f"{self.book.config.heartbeat_timeout_s:g} s); its ranks were given to other nodes")
        return node

    def held_rank(self, p: dict, node: NodeRecord) -> int:
        """The rank a failure report is about, fenced by holder: the reporting process (``holder``) must
        be the one holding it now; an older holder (a restarted or replaced process) acts on nothing."""
        holder = request_field(p, "holder", str)
        rank = self.member_rank(p, node)
        holders = self.book.holders
        if holder != holders[rank]:
            raise Refused(409, f"stale holder {holder!r} of rank {rank} (now {holders[rank]!r})",
                          generation=self.book.generation)
        return rank

    def member_rank(self, p: dict, node: NodeRecord) -> int:
        """The rank a request is about: the one its ``holder`` holds when given (ranks are renumbered by
        scale events, a process's holder id never changes), else ``rank``."""
        holder = p.get("holder")
        holders = self.book.holders
        rank = next((r for r, h in holders.items() if h == holder), None) if isinstance(holder, str) else None
        if rank is None:
            rank = request_field(p, "rank", int)
        if self.book.members.get(rank) != node.node_rank:
            raise Refused(403, f"rank {rank} is not held by node {node.node_rank}")
        return rank

    # ---- handlers (with the lock held) -------------------------------------------------------------
    def join(self, p: dict) -> dict:
        """A node joins the rendezvous; the last one to join completes it (ranks by node rank, the first
        generation). Later joins are the policy's."""
        b = self.book
        if b.state is not JobState.RENDEZVOUS:
            return self.late_join(p)
        node = self.join_request(p)
        known = b.nodes.get(node.node_rank)
        if known and (known.nproc, known.host, known.spares) != (node.nproc, node.host, node.spares):
            raise Refused(409, f"node_rank {node.node_rank} already joined from {known.host}")
        b.nodes[node.node_rank] = node
        self.journal.log(Decision.JOIN, node_rank=node.node_rank, host=node.host, nproc=node.nproc,
                         spares=node.spares)
        if len(b.nodes) == b.config.nnodes:
            offset = 0
            for node in (b.nodes[n] for n in sorted(b.nodes)):
                node.rank_offset = offset
                node.last_seen = self.clock()
                b.members.update({r: node.node_rank for r in range(offset, offset + node.nproc)})
                b.holders.update({r: worker_holder(r, 0) for r in range(offset, offset + node.nproc)})
                node.spare_ids = [spare_id(node.node_rank, i) for i in range(node.spares)]
                for sid in node.spare_ids:
                    b.spares.add(sid, node.node_rank)
                offset += node.nproc
            b.state = JobState.RUNNING
            self.lifecycle.bump("rendezvous_complete")
        return {"joined": True}

    def join_request(self, p: dict) -> NodeRecord:
        """The node a ``join`` describes, its fields checked."""
        node_rank = request_field(p, "node_rank", int)
        nproc = request_field(p, "nproc", int)
        host = request_field(p, "host", str)
        spares, address, forming = p.get("spares", 0), p.get("address", ""), p.get("forming_store", "")
        incarnation = incarnation_field(p)
        if not isinstance(address, str):
            raise Refused(400, "malformed request: field 'address' must be str")
        if not isinstance(forming, str) or (forming and not host_port(forming)):
            raise Refused(400, "malformed request: field 'forming_store' must be HOST:PORT")
        if not isinstance(spares, int) or isinstance(spares, bool) or spares < 0:
            raise Refused(400, "malformed request: field 'spares' must be an int >= 0")
        config = self.book.config
        limit = max(config.nnodes, config.max_nodes or 0)
        if not 0 <= node_rank < limit:
            raise Refused(400, f"node_rank {node_rank} outside [0, {limit})")
        if nproc < 1:
            raise Refused(400, f"nproc must be >= 1, got {nproc}")
        return NodeRecord(node_rank, nproc, host, spares, address=address, forming_store=forming,
                          incarnation=incarnation)

    def rendezvous(self, p: dict) -> dict:
        node = self.node(p)
        b = self.book
        if b.state is JobState.RENDEZVOUS:
            return {"state": b.state.value, "joined": len(b.nodes), "nnodes": b.config.nnodes}
        node.last_seen = self.clock()
        return {
            "state": b.state.value,
            "reason": b.reason,
            "generation": b.generation,
            "world_size": len(b.members),
            "rank_offset": node.rank_offset,  # -1: a node that joined a running job; its processes are spares
            "spare_ids": node.spare_ids,
            "nnodes": b.config.nnodes,
            "store_host": b.config.store_host,
            "store_port": b.config.store_port,
        }

    def node_done(self, p: dict) -> dict:
        node = self.fence(p)
        node.done = True
        self.journal.log(Decision.NODE_DONE, node_rank=node.node_rank)
        self.lifecycle.succeed_if_finished()
        return {"state": self.book.state.value}

    def node_stopping(self, p: dict) -> dict:
        """A member node stops: it takes its ranks with it whatever generation it has seen, but one that
        names a generation not made yet is forged."""
        node = self.node(p)
        generation = request_field(p, "generation", int)
        if generation > self.book.generation:
            raise Refused(409, f"unknown future generation {generation} (current is {self.book.generation})",
                          generation=self.book.generation)
        why = text_field(p, "reason", "stopping")
        if self.book.state in (JobState.RUNNING, JobState.RENDEZVOUS):
            self.lifecycle.fail(f"node {node.node_rank} stopped: {why}")
        return {"state": self.book.state.value}

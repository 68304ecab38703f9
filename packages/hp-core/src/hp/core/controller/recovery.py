"""Recovery: what a dead rank, a failing step, a lost node or a spare's news changes.

The recovery ladder, rung by rung: a rank whose process died goes to a free spare (this node's first,
ready before starting); else its process is restarted within the job's budget; else the job stops. A
rank whose step failed in process re-forms the same membership in a new generation, until it has failed
too often and is told to exit, so that its process is replaced. The ranks of lost nodes go to spares on
the surviving ones together, in one generation.

The decisions that differ between a fixed-size and an elastic job (which spare may take a rank, what
to do when none can, what a new or ready spare means) are the policy's
(:class:`hp.core.controller.policy.RecoveryPolicy`); this part acts on them.
"""

from __future__ import annotations

from hp.core.controller.book import JobBook, Refused, describe_exit, request_field, text_field
from hp.core.controller.journal import Journal
from hp.core.controller.lifecycle import Lifecycle
from hp.core.controller.membership import Membership
from hp.core.controller.policy import RecoveryPolicy
from hp.core.protocol import Decision, FailureAction, JobState, restarted_holder, spare_holder


class Recovery:
    def __init__(self, book: JobBook, journal: Journal, lifecycle: Lifecycle, membership: Membership,
                 policy: RecoveryPolicy) -> None:
        self.book, self.journal, self.lifecycle, self.membership = book, journal, lifecycle, membership
        self.policy = policy

    # ---- lost nodes --------------------------------------------------------------------------------
    def nodes_lost(self, gone: set[int], names: str, cause: str) -> None:
        """The nodes ``gone`` (named ``names``) were lost: every rank they held goes to a free spare on a
        surviving node, in one new generation; without enough spares, the policy's answer or the job fails."""
        b = self.book
        ranks = sorted(r for r, owner in b.members.items() if owner in gone)
        if not ranks:
            return  # only spares were there: nobody's group changed
        spares = b.spares.order()
        if len(spares) < len(ranks):
            if self.policy.without_spare(ranks, f"{names} lost") is None:
                self.lifecycle.fail(f"{names} lost: {cause}; its ranks {ranks} need {len(ranks)} "
                                    f"spare(s) on the surviving nodes, {len(spares)} free")
            return
        moves = [(rank, spare, self.lifecycle.give(rank, spare)) for rank, spare in zip(ranks, spares)]
        self.lifecycle.bump("node_lost", nodes=sorted(gone), ranks=ranks)
        for rank, spare, ready in moves:
            self.lifecycle.announce(rank, spare, ready, None, f"{names} lost")

    # ---- handlers (with the lock held) -------------------------------------------------------------
    def worker_failed(self, p: dict) -> dict:
        """A worker process died. Its rank goes to a free spare (this node's first), else the
        process is restarted within the budget, else the job stops."""
        b = self.book
        node = self.membership.fence(p)
        b.require_running()
        rank = self.membership.held_rank(p, node)
        exitcode, signal_name = p.get("exitcode"), p.get("signal")
        who = f"rank {rank} (node {node.node_rank}, pid {p.get('pid')})"
        cause = describe_exit(exitcode, signal_name if isinstance(signal_name, str) else None)
        spare = self.policy.pick_spare(node.node_rank)
        if spare is None and (answer := self.policy.without_spare([rank], cause)) is not None:
            return answer
        if spare is not None:
            ready = self.lifecycle.give(rank, spare)
            self.lifecycle.bump("spare_promoted", rank=rank, spare=spare, cause=cause)
            promotion = self.lifecycle.announce(rank, spare, ready, node.node_rank, cause)
            if b.members[rank] == node.node_rank:
                return {"action": FailureAction.PROMOTE_SPARE, **promotion}
            return {"action": FailureAction.MOVED, "rank": rank, "node": b.members[rank],
                    "generation": b.generation}
        if b.restarts < b.config.max_restarts:
            b.restarts += 1
            b.rank_restarts[rank] = b.rank_restarts.get(rank, 0) + 1
            b.holders[rank] = restarted_holder(b.holders[rank])
            self.lifecycle.bump("worker_restart", rank=rank, cause=cause)
            self.journal.log(Decision.RESTART_WORKER, rank=rank, node_rank=node.node_rank, cause=cause,
                             restarts=b.restarts)
            return {"action": FailureAction.RESTART, "generation": b.generation, "rank": rank,
                    "holder": b.holders[rank]}
        message = p.get("message")
        detail = f": {message}" if isinstance(message, str) and message else ""
        spent = f"restarts exhausted ({b.restarts}/{b.config.max_restarts})"
        if b.spares.seen:
            spent = f"no spare left ({len(b.spares.seen)} started) and {spent}"
        self.lifecycle.fail(f"{who} {cause}{detail}; {spent}")
        return {"action": FailureAction.STOP, "reason": b.reason, "generation": b.generation}

    def rank_failed(self, p: dict) -> dict:
        """A worker recovered in process from a failure of its own step (an exception, a
        collective error nobody explained): same membership, new generation. A rank that keeps
        failing is told to exit, so that its process is replaced."""
        b = self.book
        node = self.membership.fence(p)
        b.require_running()
        rank = self.membership.held_rank(p, node)
        reason = text_field(p, "reason", "failure")
        if reason == "unrecoverable":  # state no peer can rebuild: in-process recovery is over
            message = text_field(p, "message", "state lost")
            self.lifecycle.fail(f"rank {rank} cannot recover in process: {message}")
            return {"action": FailureAction.STOP, "reason": b.reason, "generation": b.generation}
        # only a rank's own exceptions count against it: a collective error names no culprit
        count = b.rank_exceptions.get(rank, 0) + (reason == "exception")
        b.rank_exceptions[rank] = count
        if count > b.config.max_rank_exceptions:
            self.journal.log(Decision.ESCALATE, rank=rank, reason=reason, failures=count)
            return {"action": FailureAction.EXIT, "generation": b.generation,
                    "reason": f"rank {rank} failed in process {count} times"}
        self.lifecycle.bump("in_process_recovery", rank=rank, reason=reason)
        return {"action": FailureAction.REFORM, "generation": b.generation}

    def spare_failed(self, p: dict) -> dict:
        """A spare process died. One given a rank since its agent's last heartbeat is a dead rank: answered
        as ``worker_failed`` (its agent acts on the decision); a free one is only struck off."""
        b = self.book
        node = self.membership.fence(p)
        spare = request_field(p, "spare", str)
        holder = spare_holder(spare)
        rank = next((r for r, h in b.holders.items() if h == holder), None)
        if rank is not None and b.members.get(rank) == node.node_rank and b.state is JobState.RUNNING:
            return {"rank": rank, **self.worker_failed({**p, "rank": rank, "holder": holder,
                                                        "generation": b.generation})}
        if b.spares.free.get(spare) == node.node_rank:
            b.spares.take(spare)
            self.journal.log(Decision.SPARE_LOST, spare=spare, node_rank=node.node_rank)
        return {"free_spares": len(b.spares.free)}

    def spare_added(self, p: dict) -> dict:
        """An agent started a new hot spare (replacing a promoted one): it is free for any rank."""
        b = self.book
        node = self.membership.fence(p)
        b.require_running()
        spare = request_field(p, "spare", str)
        if (problem := b.spares.invalid_new(spare, node.node_rank)) is not None:
            raise Refused(*problem)
        b.spares.add(spare, node.node_rank)
        self.journal.log(Decision.SPARE_ADDED, spare=spare, node_rank=node.node_rank)
        answer = {"free_spares": len(b.spares.free)}
        self.policy.spare_added(spare, p)
        return answer

    def spare_ready(self, p: dict) -> dict:
        """A spare finished starting (sent by the spare itself): it goes before spares still starting.
        One promoted meanwhile, or lost, is answered ``ready: false`` and changes nothing."""
        node = self.membership.node(p)
        spare = request_field(p, "spare", str)
        ready = self.book.spares.mark_ready(spare, node.node_rank)
        if ready:
            self.journal.log(Decision.SPARE_READY, spare=spare, node_rank=node.node_rank)
            self.policy.spare_ready(spare)
        return {"ready": ready}

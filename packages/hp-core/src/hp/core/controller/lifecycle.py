"""The job's generations, what they publish, and the job's end.

Every part that changes who holds which rank ends with :meth:`Lifecycle.bump`: the generation goes up
and the workers read the new plan through the store (the plan first, then its number, so a worker that
sees the number can always read the plan). A spare given a rank is told through the store as well (its
assignment) and queued for its agent's next heartbeat. Ending the job is the last such change: failed,
preempted (every rank saves its last committed step) or, asked by an operator (``hp finish``),
finishing at the next agreed step boundary; it succeeds once every node holding a rank is done.
"""

from __future__ import annotations

from typing import Any

from hp.core.controller.book import JobBook, text_field
from hp.core.controller.journal import Journal
from hp.core.protocol import (
    GENERATION_KEY, Decision, FailureAction, JobState, Plan, SpareAssignment, plan_key, spare_holder, spare_key,
)


class Lifecycle:
    def __init__(self, book: JobBook, journal: Journal) -> None:
        self.book, self.journal = book, journal

    def bump(self, why: str, at_boundary: bool = False, **details: Any) -> None:
        self.book.generation += 1
        self.journal.log(Decision.NEW_GENERATION, why=why, world_size=len(self.book.members), **details)
        self._publish_generation(why, at_boundary)

    def _publish_generation(self, why: str, at_boundary: bool) -> None:
        """Tell every worker through the store: the plan of the new generation first, then its
        number, so a worker that sees the number can always read the plan."""
        b = self.book
        plan = Plan(b.generation, len(b.members), b.state.value, b.reason, dict(b.holders), why,
                    at_boundary, self._forming_store(), b.finishing)
        self.journal.publish(plan_key(b.generation), plan.to_json())
        self.journal.publish(GENERATION_KEY, str(b.generation))

    def _forming_store(self) -> str:
        """Where this generation's group forms: the store of the first live node holding a rank that hosts
        one (never a rank's, and a different node's once that one is lost); "": the job's store."""
        nodes = self.book.nodes
        holding = sorted(set(self.book.members.values()))
        return next((nodes[n].forming_store for n in holding
                     if n in nodes and not nodes[n].lost and nodes[n].forming_store), "")

    def give(self, rank: int, spare: str) -> bool:
        """Hand ``rank`` to a free spare (before the generation bump); returns whether it was ready."""
        spares = self.book.spares
        ready = spare in spares.ready
        self.book.members[rank] = spares.take(spare)
        self.book.holders[rank] = spare_holder(spare)
        return ready

    def announce(self, rank: int, spare: str, ready: bool, failed_node: int | None, cause: str) -> dict:
        """After the bump: log the promotion, tell the spare its rank through the store, and queue it
        for the spare's agent unless that agent reported the failure (it hears the answer)."""
        b = self.book
        owner = b.members[rank]
        self.journal.log(Decision.PROMOTE_SPARE, rank=rank, spare=spare, spare_node=owner, failed_node=failed_node,
                         cause=cause, ready=ready)
        promotion = {"spare": spare, "rank": rank, "generation": b.generation}
        self.journal.publish(spare_key(spare), SpareAssignment(rank, b.generation).to_json())
        if owner != failed_node:
            b.nodes[owner].promotions.append(promotion)
        return promotion

    def fail(self, reason: str) -> None:
        # Ending the job is the last membership change: workers waiting for a new generation
        # read its plan and stop.
        self.book.state, self.book.reason = JobState.FAILED, reason
        self.journal.log(Decision.FAIL_JOB, reason=reason)
        self.bump("job_failed")

    def preempt_job(self, reason: str) -> dict:
        """The job cannot go on without a node that is leaving: every rank saves its last committed step
        (the tiered-checkpoint rung) and exits (a failure generation: ranks abandon the step they are in,
        so the save fits in a grace period shorter than a step). Idempotent: every preempted node asks."""
        b = self.book
        if b.state is JobState.RUNNING:
            b.state, b.reason = JobState.PREEMPTED, reason
            self.journal.log(Decision.PREEMPT_JOB, reason=reason)
            self.bump("preempted")
        return {"action": FailureAction.SAVE, "generation": b.generation, "reason": b.reason}

    def succeed_if_finished(self) -> None:
        """A node reported done: the job succeeded once every node holding a rank is."""
        if self.book.state is JobState.RUNNING and self.book.finished():
            self.book.state = JobState.SUCCEEDED
            self.journal.log(Decision.JOB_SUCCEEDED)

    # ---- handler (with the lock held) ----------------------------------------------------------
    def finish(self, p: dict) -> dict:
        """An operator ends the job (``hp finish``): a planned generation of the same membership whose plan,
        and every later one, says ``finishing``. The ranks end their training loop after the next step whose
        commit vote says one of them has seen it (all after the same step: the vote is a collective), exit
        as at their last step, and the job succeeds as it does then. Asked again: the same answer."""
        self.book.require_running()
        if not self.book.finishing:
            self.book.finishing = True
            reason = text_field(p, "reason", "an operator")
            self.journal.log(Decision.FINISH, reason=reason[:200])
            self.bump("finish", at_boundary=True)
        return {"finishing": True, "generation": self.book.generation}

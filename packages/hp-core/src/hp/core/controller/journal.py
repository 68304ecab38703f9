"""The controller's journal: the decision log, the outbox, remembered answers and durability.

Every other part decides; this one makes what they decided durable and visible, in that order. With a
``persist`` function injected (the HA controller, :mod:`hp.core.leader`), every request that changed
the job is written through it *before* its answer is sent and before the values it publishes reach the
store: they wait in an outbox, itself part of the persisted state, so a replica that takes over
re-publishes what its predecessor may not have. A persist that fails (the lease was lost) *deposes*
the controller: that request and every later one is refused (503), so a deposed leader never answers
a decision it could not make durable. A request that names a ``rid`` is answered from the node's last
answers when it repeats that ``rid``: an agent that retries against the new leader a request the old
one decided gets the same decision, not a refusal.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from hp.core.controller.book import JobBook, Refused
from hp.core.protocol import Decision, JobState

log = logging.getLogger("hp.controller")

ANSWERS_KEPT = 8  # decided requests remembered per node, for a retry at a new leader (see the docstring)


class Journal:
    """``dump``: the job's durable state as JSON, given the outbox (:func:`hp.core.controller.state.dump`)."""

    def __init__(self, book: JobBook, dump: Callable[[list[tuple[str, str]]], dict],
                 publish: Callable[[str, str], None] | None = None,
                 persist: Callable[[dict, list[dict]], None] | None = None) -> None:
        self.book = book
        self.dump = dump
        self.publish_fn = publish
        self.persist_fn = persist  # (state, new decisions): durable before any answer (hp.core.leader)
        self.outbox: list[tuple[str, str]] = []  # values to publish once the state that made them is durable
        self.dirty = False  # the state changed since it was last persisted
        self.persisted = 0  # decisions already persisted
        self.deposed = ""  # why this controller may no longer decide (its lease was lost); "" while it may
        # node_rank -> its last decided requests, newest last: [{"rid", "verb", "answer"}] (its agent's and
        # its workers' interleave: a few are kept)
        self.answers: dict[int, list[dict]] = {}
        self.decisions: list[dict] = []  # made by this controller
        self.decisions_before = 0  # made by the leaders before it (HA: the count of the job's log)

    @property
    def decision_count(self) -> int:
        """Decisions made in this job, by every leader so far."""
        return self.decisions_before + len(self.decisions)

    def log(self, decision: Decision, **details: Any) -> None:
        entry = {"t": time.time(), "generation": self.book.generation, "decision": decision, **details}
        self.decisions.append(entry)
        self.dirty = self.dirty or decision is not Decision.REFUSED  # a refusal changes nothing
        if self.book.config.decision_log:
            with open(self.book.config.decision_log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def publish(self, key: str, value: str) -> None:
        """Queue ``key = value`` for the store; :meth:`commit` sends it once the decision is durable."""
        self.outbox.append((key, value))
        self.dirty = True

    def changed(self) -> None:
        """The state changed without a decision (a promotion told once: a new leader must not tell it again)."""
        self.dirty = True

    def refuse_if_deposed(self) -> None:
        if self.deposed:
            raise Refused(503, f"this controller was deposed ({self.deposed}): ask the current leader")

    def repeated(self, verb: str, payload: dict) -> dict | None:
        """The answer already given to this very request (same node, verb and ``rid``), if any."""
        rid, node = payload.get("rid"), payload.get("node_rank")
        if not isinstance(rid, str) or type(node) is not int:
            return None
        return next((a["answer"] for a in self.answers.get(node, ()) if a["rid"] == rid and a["verb"] == verb), None)

    def remember(self, verb: str, payload: dict, answer: dict) -> None:
        rid, node = payload.get("rid"), payload.get("node_rank")
        if self.dirty and isinstance(rid, str) and type(node) is int and node in self.book.nodes:
            kept = self.answers.setdefault(node, [])
            kept.append({"rid": rid, "verb": verb, "answer": answer})
            del kept[:-ANSWERS_KEPT]

    def commit(self, force: bool = False) -> None:
        """Make what the last request changed durable (when persisting), then publish its values. Not
        joins during the rendezvous: they are idempotent and an agent joins again when a new leader does
        not know its node, so persisting the whole state per join (O(nodes^2) bytes) buys nothing; the
        state is persisted when the rendezvous completes. ``force``: persist anyway (a takeover's write,
        which fences out the previous leader)."""
        waits = self.book.state is JobState.RENDEZVOUS and not self.outbox and not force
        if self.dirty and self.persist_fn is not None and not waits:
            try:
                self.persist_fn(self.dump(self.outbox), self.decisions[self.persisted:])
            except Exception as e:  # lost the lease (or the store): nothing of this request may take effect
                self.deposed = str(e) or type(e).__name__
                self.outbox.clear()
                log.error("controller deposed: %s", self.deposed)
                raise Refused(503, f"this controller was deposed ({self.deposed}): ask the current leader") from None
            self.persisted = len(self.decisions)
        self.dirty = False
        outbox, self.outbox = self.outbox, []
        if self.publish_fn is not None:
            for key, value in outbox:
                self.publish_fn(key, value)

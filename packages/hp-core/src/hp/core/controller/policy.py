"""The recovery policy: the decisions that differ between a fixed-size job and one that scales.

A :class:`hp.core.controller.Controller` is given one (by default this fixed-size one) and consults it
where a job's size could change: which spare takes a dead rank, what to do when none can, what a join
after the rendezvous, a new spare or a ready spare means, and which further verbs the job serves. The
elastic job's (:class:`hp.core.controller.elastic.ElasticPolicy`) shrinks, grows and preempts through
the same parts the controller uses; a policy changes the job only through them (:class:`Parts`), never
through the controller itself, so it is one object to read, test and replace.

A policy's own state, if it has any, is part of the job's durable state (:meth:`RecoveryPolicy.dump`),
and :attr:`RecoveryPolicy.kind` names the controller in it: a replica refuses to take over a job whose
controller is of another kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hp.core.controller.book import JobBook, Refused
from hp.core.controller.journal import Journal
from hp.core.controller.lifecycle import Lifecycle
from hp.core.controller.membership import Membership
from hp.core.protocol import Verb


@dataclass(frozen=True)
class Parts:
    """What a policy acts through: the job's book and the parts that change it."""

    book: JobBook
    journal: Journal
    lifecycle: Lifecycle
    membership: Membership
    clock: Callable[[], float]


class RecoveryPolicy:
    """The fixed-size job's decisions (``hp run --nnodes N``): a dead rank takes the best free spare, else
    the restart rungs; nodes join only during the rendezvous; scaling verbs are refused. Subclass it and
    replace the decisions that differ; :meth:`bind` is called once, by the controller given the policy."""

    kind = "Controller"  # the controller's name in the durable state (hp.core.controller.state)

    def __init__(self) -> None:
        self._parts: Parts | None = None

    def bind(self, parts: Parts) -> None:
        if self._parts is not None:
            raise ValueError("a recovery policy serves one controller")
        self._parts = parts

    @property
    def parts(self) -> Parts:
        if self._parts is None:
            raise RuntimeError("this recovery policy was not given to a controller")
        return self._parts

    # ---- decisions ------------------------------------------------------------------------------
    def pick_spare(self, node_rank: int) -> str | None:
        """The spare that takes a dead rank of ``node_rank`` (None: none can)."""
        return self.parts.book.spares.pick(node_rank)

    def without_spare(self, ranks: list[int], cause: str) -> dict | None:
        """``ranks`` died and no spare can take them: an elastic job shrinks instead (its answer);
        None: the fixed-size rungs (restart the process, else stop the job)."""
        return None

    def late_join(self, p: dict) -> dict:
        """A ``join`` after the rendezvous: a fixed-size job has all its nodes."""
        node = self.parts.membership.join_request(p)
        state = self.parts.book.state
        raise Refused(409, f"job is {state.value}; node {node.node_rank} cannot join now")

    def spare_added(self, spare: str, p: dict) -> None:
        """``spare`` (from the request ``p``) was added to the free spares."""

    def spare_ready(self, spare: str) -> None:
        """``spare`` reported ready."""

    def verbs(self) -> dict[Verb, Callable[[dict], dict]]:
        """Verbs this policy serves beyond the controller's own (called with the lock held)."""
        return {Verb.NODE_LEAVING: self.not_elastic, Verb.SCALE: self.not_elastic}

    def not_elastic(self, p: dict) -> dict:
        raise Refused(409, "this job has a fixed size: start it with `hp run --nnodes MIN:MAX --scaling-policy FILE` "
                           "to scale it")

    # ---- what it adds to the controller's views -------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Fields the ``state`` answer adds."""
        return {}

    def dump(self) -> dict[str, Any] | None:
        """The policy's own durable state (the ``elastic`` section), None: it has none."""
        return None

    def load(self, state: dict[str, Any]) -> None:
        """Take over :meth:`dump`'s output (raises KeyError, TypeError or ValueError when malformed)."""

"""The controller's book of hot spares: which are free, on which node, which are ready.

Part of the job's book (:mod:`hp.core.controller.book`), kept apart so that the rules for choosing a
spare live in one place (which one takes a dead rank is the recovery policy's call, from the order
given here). A spare is *ready* once it has said so (its imports are done and its hydration buffer is
faulted in): promoting one that is still starting makes the whole job wait for its ``import torch``,
seconds against the fraction of a second a ready one needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hp.core.protocol import spare_id


@dataclass
class SparePool:
    free: dict[str, int] = field(default_factory=dict)  # spare id -> node_rank, waiting for a rank
    seen: set[str] = field(default_factory=set)  # every id ever registered: a promoted one never comes back
    ready: set[str] = field(default_factory=set)  # free spares that reported ready

    def invalid_new(self, spare: str, node_rank: int) -> tuple[int, str] | None:
        """Why a spare an agent says it started cannot be added, as (HTTP status, message); None if it can."""
        prefix = spare_id(node_rank, 0)[:-1]
        if not (spare.startswith(prefix) and spare[len(prefix):].isdigit()):
            return 400, f"spare id {spare!r} of node {node_rank} must look like {prefix}<k>"
        if spare in self.seen:  # ids are never reused: a spare's store key is final
            return 409, f"spare id {spare!r} was already used in this job"
        return None

    def add(self, spare: str, node_rank: int) -> None:
        self.seen.add(spare)
        self.free[spare] = node_rank

    def take(self, spare: str) -> int:
        """Remove ``spare`` from the free ones (promoted or lost); returns its node."""
        self.ready.discard(spare)
        return self.free.pop(spare)

    def mark_ready(self, spare: str, node_rank: int) -> bool:
        """False when ``spare`` is not a free spare of that node (promoted meanwhile, or lost)."""
        if self.free.get(spare) != node_rank:
            return False
        self.ready.add(spare)
        return True

    def drop_nodes(self, nodes: set[int]) -> None:
        """Spares of lost nodes died with them."""
        for spare in [s for s, owner in self.free.items() if owner in nodes]:
            self.take(spare)

    def order(self, node_rank: int | None = None) -> list[str]:
        """Free spares, best first: ready before still starting, then ``node_rank``'s own (no
        cross-node transfer), then by id (deterministic)."""
        return sorted(self.free, key=lambda s: (s not in self.ready, self.free[s] != node_rank, s))

    def pick(self, node_rank: int) -> str | None:
        best = self.order(node_rank)
        return best[0] if best else None

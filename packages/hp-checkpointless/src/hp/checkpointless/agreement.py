"""What the ranks of a new generation agree on at its formation (the same on every rank): the newest
committed step, who is behind, where each rank hydrates from, and the sharded state's partitionings.

Built by :mod:`hp.checkpointless.formation` from one all-gather; read by :mod:`hp.checkpointless.hydration`
and :mod:`hp.checkpointless.reshard`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp.checkpointless import sharded


@dataclass(frozen=True)
class Agreement:
    """What the ranks of a new generation agreed on (the same on every rank)."""

    generation: int
    newest: int  # the newest committed step any rank holds
    source: int  # the lowest rank at ``newest``
    behind: list[int]  # ranks below ``newest``
    versions: sharded.Versions
    # the sharded optimizer's previous partitioning when a scale event changed it (-1 and (): unchanged):
    # its world size, and for each new rank the rank it had in it (-1: no shard, e.g. a joiner)
    previous_world: int = -1
    previous_ranks: tuple[int, ...] = ()
    # the replication ring of the partitioning the held shards and replicas are in (the previous one
    # when resharding), by which each rank's buddy is found; (): the identity (buddy r + 1)
    ring: tuple[int, ...] = ()
    # an FSDP model's: per rank, the step of the gradients that came with its copy of its ward's shard
    replica_grads: tuple[int, ...] = ()
    nodes: tuple[int, ...] = ()  # each rank's node (a source packs a hydration into a same-node receiver's memory)
    skipped: int = -1  # an FSDP model's newest committed step whose update the job skipped (GradScaler: inf/NaN)

    def same_node(self, a: int, b: int) -> bool:
        return bool(self.nodes) and self.nodes[a] == self.nodes[b]

    def source_for(self, rank: int) -> int:
        """Where a rank behind gets replicated state: the lowest up-to-date rank on its node (through shared
        memory), else :attr:`source`. Any up-to-date rank holds the same replicated state."""
        if self.nodes:
            for r in range(len(self.nodes)):
                if r not in self.behind and self.nodes[r] == self.nodes[rank]:
                    return r
        return self.source

    def node_sources(self, rank: int, count: int = 2) -> tuple[int, ...]:
        """The ``count`` lowest ranks on ``rank``'s node: where a same-node hydration on it comes from
        unless all of them are behind (:mod:`hp.checkpointless.premap` maps spares' buffers there)."""
        if not self.nodes:
            return ()
        return tuple(r for r, n in enumerate(self.nodes) if n == self.nodes[rank])[:count]

    def resharding(self, world: int) -> bool:
        """Whether optimizer shards move: another world size, or a survivor with another rank."""
        return self.previous_world >= 0 and (self.previous_world != world or any(
            old not in (-1, new) for new, old in enumerate(self.previous_ranks)))

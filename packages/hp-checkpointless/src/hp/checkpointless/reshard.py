"""Resharding a sharded optimizer (ZeRO-1) when the world size changes: elastic shrink and grow, in
process, with no checkpoint I/O.

torch's ``ZeroRedundancyOptimizer`` partitions the parameters by a deterministic function of the
parameter list and the world size, so after a scale event a parameter's optimizer state usually
belongs to another rank. :meth:`hp.checkpointless.sharded.ShardedOptimizer.rebind` has already
re-partitioned the optimizer for the new world; each survivor still holds its shard of the old
partitioning, and the replica of its ward's shard. Then, the same plan on every rank:

1. Every OLD partition is brought to the newest committed step from what the survivors hold: its
   owner's shard (rolled forward by the owner when it missed the vote of that step), or, for an owner
   that is gone, its buddy's replica (its successor in the old partitioning's ring; rolled forward by
   the buddy when one step old), exactly as for a replacement (:func:`hp.checkpointless.sharded.plan_shard_sources`; :class:`ShardLost` when neither is left).
2. The rank that provides an old partition sends each new owner the parameters of that partition it now
   owns: their values and their optimizer states (two checksummed flat buffers, never pickled), in one
   order that every rank follows, so blocking transfers cannot wait on each other in a cycle.
3. The caller then syncs the parameters at the new world (each new owner broadcasts its partition) and
   only after that collective :meth:`~hp.checkpointless.sharded.ShardedOptimizer.adopt` s the moved states:
   until then every rank still holds its old shard and replica intact, so a re-form that fails midway
   can reshard again from the same old partitioning.

The moved state is what each new owner keeps (about 1/W' of the whole); no rank assembles all of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hp.checkpointless import state, transfer
from hp.checkpointless.events import EventLog
from hp.checkpointless.sharded import (ShardedOptimizer, Versions, check_ring, own_roll_forward_needed,
                                       plan_shard_sources, ward_in)
from hp.checkpointless.transaction import StepTransaction
from hp.core.protocol import Event

if TYPE_CHECKING:
    from hp.checkpointless.agreement import Agreement

Shard = tuple[list[torch.Tensor], list[dict]]  # a partition's parameter values and their optimizer states


def old_versions(v: Versions, previous_ranks: tuple[int, ...], previous_world: int) -> Versions:
    """The agreement's rows (indexed by new rank) indexed by old rank; -1 for an old rank that is gone."""
    rows = [[-1] * previous_world for _ in range(4)]
    for new, old in enumerate(previous_ranks):
        if old >= 0:
            for row, got in zip(rows, (v.committed, v.shard, v.replica, v.grads)):
                row[old] = got[new]
    return Versions(*rows)


def reshard(sh: ShardedOptimizer, tx: StepTransaction, a: Agreement, rank: int,
            events: EventLog) -> dict[torch.Tensor, dict]:
    """Steps 1 and 2 above; returns the optimizer states of this rank's new partition, by parameter.
    Raises :class:`ShardLost` (on every rank alike) when an old partition exists nowhere."""
    old_world, newest, world = a.previous_world, a.newest, sh.world_size
    if len(a.previous_ranks) != world:
        raise ValueError(f"previous_ranks has {len(a.previous_ranks)} entries for a world of {world}")
    mine = a.previous_ranks[rank]
    if mine >= 0 and sh.partition != (mine, old_world):
        raise ValueError(f"the agreement puts rank {rank}'s shard at rank {mine} of {old_world}; "
                         f"it holds rank {sh.partition[0]} of {sh.partition[1]}")
    ring = check_ring(a.ring, old_world)  # the old partitioning's ring: its replicas were made along it
    if mine >= 0 and sh.held_ring != ring:
        raise ValueError(f"the agreement's ring {list(ring)} is not the one rank {rank}'s replicas were made "
                         f"with: {list(sh.held_ring)}")
    v = old_versions(a.versions, a.previous_ranks, old_world)
    rebuild = plan_shard_sources(v, newest, ring)  # old rank -> its old buddy
    new_rank = {old: new for new, old in enumerate(a.previous_ranks) if old >= 0}
    provider = [new_rank[rebuild.get(old, old)] for old in range(old_world)]
    shards: dict[int, Shard] = {}
    if mine >= 0:
        if own_roll_forward_needed(v, mine, newest):  # missed the vote of `newest` only
            sh.roll_held_forward(newest, tx.grads)
            events.record(Event.SHARD_REBUILT, rank=rank, partition=mine, previous_world=old_world, step=newest,
                          buddy=None, rolled_forward=True, generation=a.generation)
        if mine not in rebuild:
            shards[mine] = sh.held_shard()
        ward = ward_in(ring, mine)
        if rebuild.get(ward) == mine:
            values, states, rolled = sh.ward_shard(newest, tx.grads if tx.grads_step == newest else None)
            shards[ward] = values, states
            events.record(Event.SHARD_REBUILT, rank=rank, partition=ward, previous_world=old_world, step=newest,
                          buddy=rank, rolled_forward=rolled, generation=a.generation)
    return _move(sh, shards, provider, old_world, rank)


def _move(sh: ShardedOptimizer, shards: dict[int, Shard], provider: list[int], old_world: int,
          rank: int) -> dict[torch.Tensor, dict]:
    """Each old partition's parameters to their new owners: values into the live parameters, states
    returned (received ones in buffers of their own, so the optimizer may keep them)."""
    old, new = sh.partitioning(old_world), sh.partitioning(sh.world_size)
    owner = {p: n for n, params in enumerate(new) for p in params}
    states: dict[torch.Tensor, dict] = {}
    for o, params in enumerate(old):
        src = provider[o]
        for dst in range(len(new)):
            picked = [i for i, p in enumerate(params) if owner[p] == dst]
            if not picked or rank not in (src, dst):
                continue
            targets = [params[i] for i in picked]
            if rank == src:
                values, sent = [shards[o][0][i] for i in picked], [shards[o][1][i] for i in picked]
                if rank == dst:
                    with torch.no_grad():
                        for p, value in zip(targets, values):
                            if p.data_ptr() != value.data_ptr():  # a copy of the replica; the held shard is live
                                p.copy_(value)
                    states.update(zip(targets, sent))
                else:
                    transfer.send_state({"params": values}, dst)
                    transfer.send_state({"states": sent}, dst)
            else:
                transfer.recv_state(src, template={"params": [p.detach() for p in targets]})  # in place, once checked
                received = transfer.recv_state(src)["states"]
                if len(received) != len(targets):
                    raise state.StateTransferError(f"rank {src} sent {len(received)} optimizer states for "
                                                   f"{len(targets)} parameters")
                states.update(zip(targets, received))
    return states

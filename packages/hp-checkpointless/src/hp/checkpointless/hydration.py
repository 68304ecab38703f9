"""Hydration after a re-form: the ranks behind the newest committed step get the state they lack.

Replicated state (DDP-style): every up-to-date rank holds all of it; a rank behind gets it whole from
the lowest up-to-date rank of its node, packed straight into its memory (:mod:`hp.checkpointless.shm`),
else from the lowest up-to-date rank over the transport.
Sharded optimizer state (:mod:`hp.checkpointless.sharded`): each missing shard comes from the owner's
buddy (the next rank in the ring its replicas were made with) (rolled forward when one step old), the replicated rest (buffers, LR schedule, RNG, extras)
from the lowest up-to-date rank, each partition's parameters from its owner; then shards are
replicated again. After a scale event that changed the partitioning, the shards are resharded first
(:mod:`hp.checkpointless.reshard`). An FSDP2 model's shards (:mod:`hp.checkpointless.fsdp`) come from a
rank of the same replicate group (HSDP) or from the buddy's copy, rolled forward (FSDP). Every
transfer is one checksummed flat buffer (:mod:`hp.checkpointless.state`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from hp.checkpointless import fsdp, reshard, sharded, shm, state, transfer
from hp.checkpointless.agreement import Agreement
from hp.checkpointless.events import EventLog
from hp.checkpointless.premap import Premaps
from hp.checkpointless.registry import TrainingState
from hp.checkpointless.replicas import check_ring
from hp.checkpointless.transaction import StepTransaction
from hp.core.protocol import Event


def replicated(st: TrainingState, a: Agreement, rank: int, events: EventLog) -> None:
    """Replicated state: each rank behind pulls everything from :meth:`Agreement.source_for`; on the
    source's node it offers its shared receive buffer, and the source packs the state straight into it
    (:mod:`hp.checkpointless.shm`)."""
    for r in a.behind:
        source = a.source_for(r)
        if rank == source:
            captured = st.capture()
            target = _attach_offer(r, captured, st.premaps) if a.same_node(source, r) else None
            try:
                transfer.send_state(captured, r, in_place=None if target is None else target.tensor)
                how = "transport" if target is None else "premapped" if target.early else "shm"
                events.record(Event.HYDRATION_SENT, rank=rank, to=r, how=how, generation=a.generation)
            finally:
                if target is not None and st.premaps is not None:
                    st.premaps.hold(target)  # unmapped at the next step boundary (premap.Premaps.hold)
                elif target is not None:
                    target.close()
        elif rank == r:
            # in place into our own tensors when the layouts match; a fresh process's optimizer
            # has no state yet, so it receives into a new buffer the optimizer then keeps
            has_state = st.optimizer is None or bool(st.optimizer.state)
            shared = st.receive_shared if not has_state else None
            if a.same_node(source, r):
                transfer.send_tensor(shm.no_offer() if shared is None else shared.offer(), source)
            try:
                received = transfer.recv_state(source, template=st.capture() if has_state else None,
                                               buffer=None if has_state else st.receive_buffer)
            finally:
                if shared is not None:  # offered once: a retry of this hydration goes over the transport
                    shared.received()
                    st.receive_shared = None
            st.receive_buffer = None  # the optimizer and parameters own those bytes now: never receive into them
            st.restore(received, adopt=not has_state)
            _hydrated(st, a, rank, events, source)


def _attach_offer(receiver: int, captured: dict, premaps: Premaps | None) -> shm.SharedBuffer | None:
    """The source's side of a same-node hydration: the receiver's offer, attached when it is one (else the
    state goes over the transport: a receiver with state of its own, or a buffer this rank cannot use);
    mapped before the failure when this rank saw it offered (:mod:`hp.checkpointless.premap`)."""
    offer = transfer.recv_tensor(shm.no_offer(), receiver)
    if not shm.offered(offer):
        return None
    nbytes = state.wire_nbytes(captured)
    early = premaps.take(offer, nbytes) if premaps is not None else None
    if early is not None:
        return early
    try:
        return shm.SharedBuffer.attach(offer, nbytes)
    except (OSError, ValueError) as e:
        print(f"hp: hydrating rank {receiver} over the transport: {e}", file=sys.stderr, flush=True)
        return None


def sharded_optimizer(st: TrainingState, tx: StepTransaction, a: Agreement, rank: int,
                      collective: Callable, events: EventLog) -> None:
    """Sharded optimizer: shards come from buddies (rolled forward where one step old), the
    replicated rest from the source, partitions from their owners; then shards are re-replicated.
    After a change of partitioning the shards are resharded, and adopted once the partitions are synced."""
    sh = st.sharded
    if a.resharding(sh.world_size):
        moved = reshard.reshard(sh, tx, a, rank, events)
    else:
        moved = None
        _rebuild_shards(sh, tx, a, rank, events)
    _replicated_rest(st, a, rank, events)
    # a rank gets past this all-gather only once every rank has received its new partition
    collective(sh.sync_params)
    if moved is not None:
        sh.adopt(moved, a.newest)
    sh.replicate(rank, collective)


def fsdp_shards(st: TrainingState, a: Agreement, rank: int, collective: Callable, events: EventLog) -> None:
    """An FSDP2 model: ranks that missed the vote roll their own shard forward, a replacement gets its
    shard from a rank holding the same one (HSDP) or from its buddy's shadow, rolled forward when one step
    behind (FSDP); the replicated rest from the source; then (pure FSDP) shadows that fell behind catch up,
    and a rank whose shadow is missing or stale (a replacement's) gets its ward's shard copied whole."""
    fs, optimizer = st.fsdp, st.optimizer
    fs.skipped = max(fs.skipped, a.skipped)  # a roll-forward (own, a replica's, a shadow's) of a skipped step updates nothing
    v = fsdp.ShardVersions(a.versions.shard, a.versions.grads, a.versions.replica, list(a.replica_grads))
    rolls, sources = fsdp.plan_sources(v, a.newest, fs.mesh.layout, fs.ring)  # ShardLost: on every rank alike
    if rank in rolls:  # finished the backward of `newest`, missed its vote: its own gradients are still there
        fs.roll_forward(optimizer, a.newest)
        events.record(Event.SHARD_REBUILT, rank=rank, step=a.newest, buddy=None, rolled_forward=True,
                      generation=a.generation)
    for r, (src, roll) in sorted(sources.items()):
        if rank == src:
            transfer.send_state(fs.copy_for_replacement(optimizer, a.newest), r)
        elif rank == r:
            message = transfer.recv_state(src)  # a fresh buffer: the optimizer keeps its tensors
            with transfer.from_peer(src, "shard"):
                at = int(message["at"])
                if at != a.newest and (message["grads"] is None or at != a.newest - 1):
                    raise state.StateTransferError(f"rank {src} sent a shard of step {at} without what brings "
                                                   f"it to step {a.newest}")
                fs.load_shard(optimizer, message["shard"], at)
                if at != a.newest:
                    fs.roll_forward(optimizer, a.newest, message["grads"], message["hyper"])
            events.record(Event.SHARD_REBUILT, rank=r, step=a.newest, buddy=src, rolled_forward=roll,
                          generation=a.generation)
    _replicated_rest(st, a, rank, events)
    fs.advance_shadow(a.newest)  # a buddy that missed the vote of `newest` re-runs its ward's update now
    if not fs.buddies:
        return
    world = fs.mesh.layout.world
    stale = fsdp.stale_shadows(v, a.newest, ring_kept=check_ring(fs.ring, world) == check_ring(a.ring, world))
    if stale:
        fs.sync(rank, optimizer, collective, stale)
        events.record(Event.SHADOWS_COPIED, rank=rank, ranks=stale, generation=a.generation)


def _replicated_rest(st: TrainingState, a: Agreement, rank: int, events: EventLog) -> None:
    """Sharded state's replicated rest (buffers, LR schedule, RNG, extras) from the source to each rank behind."""
    for r in a.behind:
        if rank == a.source:
            transfer.send_state(st.replicated_part(), r)
        elif rank == r:
            st.load_replicated_part(transfer.recv_state(a.source))
            _hydrated(st, a, rank, events)


def _rebuild_shards(sh: sharded.ShardedOptimizer, tx: StepTransaction, a: Agreement, rank: int,
                    events: EventLog) -> None:
    """Same partitioning: each shard behind ``a.newest`` from its buddy, or rolled forward by its owner."""
    v, newest = a.versions, a.newest
    rebuild = sharded.plan_shard_sources(v, newest, a.ring)  # ShardLost: the same verdict on every rank
    if sharded.own_roll_forward_needed(v, rank, newest):  # missed the vote of `newest` only
        tx.load_grads()
        sh.local_step(newest)
        events.record(Event.SHARD_REBUILT, rank=rank, step=newest, buddy=None, rolled_forward=True,
                      generation=a.generation)
    for r, buddy in sorted(rebuild.items()):
        if rank == buddy:
            sh.send_for_replacement(r, v, newest, tx.grads if tx.grads_step == newest else None)
        elif rank == r:
            rolled = sh.receive_as_replacement(buddy, newest)
            events.record(Event.SHARD_REBUILT, rank=r, step=newest, buddy=buddy, rolled_forward=rolled,
                          generation=a.generation)


def _hydrated(st: TrainingState, a: Agreement, rank: int, events: EventLog, source: int | None = None) -> None:
    st.mark_committed(a.newest)
    events.record(Event.HYDRATED, rank=rank, step=a.newest, source=a.source if source is None else source,
                  generation=a.generation)

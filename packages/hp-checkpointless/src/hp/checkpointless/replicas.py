"""Buddy replicas of sharded state: each rank's shard copied to the next rank of a ring after it changes.

A sharded state (ZeRO-1's optimizer shards, :mod:`hp.checkpointless.sharded`; FSDP2's parameter and
optimizer shards, :mod:`hp.checkpointless.fsdp`) exists once per shard, so no peer can hand a
replacement "the" state the way DDP replicas can. Each rank therefore keeps a copy of its **ward**'s
shard (the previous rank in the **ring**, a permutation of the ranks agreed at the re-form that made
the sharding) in CPU memory, and its **buddy** (the next rank) keeps its own. The ring puts
consecutive ranks on different nodes whenever it can (:func:`node_ring`), so a lost node never takes
a shard and its only copy with it; without one (a single node) it is the identity: buddy
``(rank + 1) % W``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hp.checkpointless import state, transfer

NO_REPLICA = -2  # a replica's version while a rank holds no copy (-1 is a copy of the state before the first step)


def identity(world: int) -> tuple[int, ...]:
    return tuple(range(world))


def node_ring(nodes: Sequence[int]) -> tuple[int, ...]:
    """A ring over the ranks (``nodes[r]``: rank r's node) in which consecutive ranks are on different
    nodes whenever possible: ranks ordered by (index of the rank within its node, node). One node (or
    none known) gives the identity; 2 nodes of 2 ranks ([0, 0, 1, 1]) give (0, 2, 1, 3)."""
    seen: dict[int, int] = {}
    keys = []
    for r, n in enumerate(nodes):
        keys.append((seen.get(n, 0), n, r))
        seen[n] = seen.get(n, 0) + 1
    return tuple(r for _, _, r in sorted(keys))


def buddy_in(ring: Sequence[int], rank: int) -> int:
    """The rank after ``rank`` in ``ring`` (that holds its replica)."""
    return ring[(ring.index(rank) + 1) % len(ring)]


def ward_in(ring: Sequence[int], rank: int) -> int:
    """The rank before ``rank`` in ``ring`` (whose replica it holds)."""
    return ring[(ring.index(rank) - 1) % len(ring)]


def check_ring(ring: Sequence[int], world: int) -> tuple[int, ...]:
    """``ring`` as a tuple (() : the identity), checked to be a permutation of the ``world`` ranks."""
    ring = tuple(int(r) for r in ring) or identity(world)
    if sorted(ring) != list(range(world)):
        raise ValueError(f"{list(ring)} is no ring over {world} ranks")
    return ring


def ring_exchange(ring: Sequence[int], rank: int, send: Callable[[int], None], receive: Callable[[int], None],
                  move: Callable[[Callable[[], None]], None]) -> None:
    """Every rank sends to its buddy (``send(buddy)``) and receives from its ward (``receive(ward)``), each
    transfer run by ``move``. Even positions in the ring send first, odd ones receive first: no cycle of
    blocked sends for any ring length (an odd one ends with two senders in a row: the last sends to
    position 0, which receives once its own send is done)."""
    if len(ring) < 2:
        return
    buddy, ward = buddy_in(ring, rank), ward_in(ring, rank)
    ops = (lambda: send(buddy), lambda: receive(ward))
    for op in (ops if ring.index(rank) % 2 == 0 else ops[::-1]):
        move(op)


class Replicas:
    """What a rank holds of its ward's shard, refreshed by a ring exchange: each rank sends its own
    shard to its buddy (the next rank in the ring) and keeps the one its ward (the previous one) sends,
    in two alternating buffers, so that a transfer that dies midway never damages the copy it already
    has. The mechanism of every sharded state hp keeps (ZeRO's optimizer shards, FSDP2's shards); a
    shard is any state dict (:mod:`hp.checkpointless.state`) with an int ``version``."""

    def __init__(self) -> None:
        self.held: dict | None = None  # the ward's shard (views into the active buffer)
        self.version = NO_REPLICA
        self._buffers = [state.StateBuffer(None), state.StateBuffer(None)]
        self._active = 0

    def exchange(self, ring: Sequence[int], rank: int, own: Callable[[], dict],
                 move: Callable[[Callable[[], None]], None]) -> None:
        """Send ``own()`` to the buddy, keep the ward's. ``move`` runs one transfer (it turns transport
        errors into the runtime's collective errors)."""
        ring_exchange(ring, rank, lambda buddy: transfer.send_state(own(), buddy), self._receive, move)

    def _receive(self, ward: int) -> None:
        spare = self._buffers[1 - self._active]
        received = transfer.recv_state(ward, buffer=spare)
        with transfer.from_peer(ward, "shard copy"):
            version = int(received["version"])
        self._active = 1 - self._active
        self.held, self.version = received, version

    def drop(self) -> None:
        self.held, self.version = None, NO_REPLICA

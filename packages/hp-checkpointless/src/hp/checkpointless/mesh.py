"""A device mesh whose process groups follow the generations: FSDP2 and HSDP under hp.

FSDP2 (``fully_shard``) and DTensor keep the process groups of the mesh they were given: in each
FSDP state's mesh info, in every DTensor's spec, in the optimizer's state. A new generation (a spare
took a dead rank's place) forms new groups, and nothing public re-points all those holders. So the
mesh hp hands out (:meth:`hp.checkpointless.Context.device_mesh`) is made of :class:`StableGroup` s:
process group objects that hold no connection themselves and forward every collective to the group
of the current generation (torchft's reconfigurable groups do the same). Forming a generation binds
them, one group per mesh dimension, made by the transport among that group's members only
(:meth:`hp.core.transport.ProcessGroupTransport.new_subgroup`); releasing it unbinds them first, so that
FSDP's references keep nothing of a failed group alive (DESIGN.md: destroying a gloo group frees its
sockets, and releases the peers blocked on them, only once nothing else holds it).

Every collective passes through ``before(op)`` first: the runtime's point to stop a step whose
generation is already dead (FSDP's collectives are where a sharded step spends its communication) and
to fire the fault-injection phase of the gradient reduction.

:class:`MeshLayout` is pure: the mesh's shape and which ranks share a group. torchtitan's layout: a
rank's coordinates are its row-major index, the last dimension (``shard``) fastest, so a shard group
is consecutive ranks (a node's, usually) and a replicate group takes one rank of each shard group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hp.checkpointless.sharded import ShardLost
from hp.core import pg
from hp.core.errors import UsageError

REPLICATE, SHARD = "replicate", "shard"


@dataclass(frozen=True)
class MeshLayout:
    """The shape of a data-parallel mesh: ``(shard,)`` for FSDP, ``(replicate, shard)`` for HSDP."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, world: int, replicate: int | None = None, shard: int | None = None) -> MeshLayout:
        """FSDP over all ranks (neither given, or ``replicate=1``), or HSDP: ``replicate`` groups of ``shard``
        ranks. ``shard`` alone: HSDP with as many replica groups as the world holds (two dimensions even
        with one: the mesh of an elastic job, whose replica groups come and go)."""
        if replicate is None and shard is not None:
            if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or world % shard:
                raise UsageError(f"a mesh of shard groups of {shard!r} ranks does not cover the job's {world} ranks")
            return cls((REPLICATE, SHARD), (world // shard, shard))
        replicate = 1 if replicate is None else replicate
        if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
            raise UsageError(f"replicate must be a positive int, got {replicate!r}")
        if shard is None:
            shard = world // replicate
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or replicate * shard != world:
            raise UsageError(f"a mesh of replicate={replicate} x shard={shard} does not cover the job's "
                             f"{world} ranks")
        if replicate == 1:
            return cls((SHARD,), (shard,))
        return cls((REPLICATE, SHARD), (replicate, shard))

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    @property
    def replicas(self) -> int:
        """How many ranks hold each shard (1: plain FSDP, every shard exists once)."""
        return self.sizes[self.names.index(REPLICATE)] if REPLICATE in self.names else 1

    def coords(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world} ranks")
        out = []
        for size in reversed(self.sizes):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank_of(self, coords: Sequence[int]) -> int:
        rank = 0
        for c, size in zip(coords, self.sizes):
            rank = rank * size + c
        return rank

    def group_ranks(self, rank: int, dim: int) -> list[int]:
        """The ranks in ``rank``'s group along dimension ``dim`` (they differ from it in ``dim`` only)."""
        coords = list(self.coords(rank))
        out = []
        for c in range(self.sizes[dim]):
            coords[dim] = c
            out.append(self.rank_of(coords))
        return out

    def resized(self, world: int) -> MeshLayout | None:
        """The layout at ``world`` ranks with the same shard groups (HSDP: whole replica groups more or
        fewer), None when there is none (pure FSDP: its shards are of its one shard group's size)."""
        if world == self.world:
            return self
        shard = self.sizes[-1]
        if REPLICATE not in self.names or world < shard or world % shard:
            return None
        return MeshLayout(self.names, (world // shard, shard))

    def holders(self, rank: int) -> list[int]:
        """Every rank holding the same shard as ``rank`` (itself included): its replicate group."""
        return self.group_ranks(rank, self.names.index(REPLICATE)) if REPLICATE in self.names else [rank]

    def grid(self) -> list:
        """Every rank at its coordinates (nested lists, as ``DeviceMesh`` takes its ``mesh``)."""
        ranks: Any = list(range(self.world))
        for size in reversed(self.sizes[1:]):
            ranks = [ranks[i:i + size] for i in range(0, len(ranks), size)]
        return ranks


def _unbound(group: StableGroup, op: str) -> Any:
    raise RuntimeError(f"hp: the {group.group_name} group of the last generation was released ({op})")


class StableGroup(dist.ProcessGroup):
    """A process group object that outlives generations: every collective goes to ``inner``, the
    group of the current generation (raises while unbound). ``rank()`` and ``size()`` are those of the
    current generation's group: a generation that replaces a rank keeps them; an elastic HSDP job that
    loses or gains replica groups changes the replicate dimension's (:meth:`resize`). torch's own callers
    (FSDP's gradient divisor, ``get_world_size(group)``) ask them from Python; the C++ side keeps the
    sizes the group was made with, which it uses only to shape collectives along the shard dimension
    (never resized)."""

    def __init__(self, rank: int, size: int, name: str, before: Callable[[str], None] | None = None) -> None:
        super().__init__(rank, size)
        self._name, self._before = name, before
        self._rank, self._size = rank, size
        self._inner: dist.ProcessGroup | None = None

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def resize(self, rank: int, size: int) -> None:
        """This rank's place in the group from the next :meth:`bind` on (unbound: between generations)."""
        if self._inner is not None:
            raise RuntimeError(f"{self._name}: resized while bound to a generation's group")
        if not 0 <= rank < size:
            raise ValueError(f"{self._name}: rank {rank} in a group of {size}")
        self._rank, self._size = rank, size

    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "hp-stable"

    @property
    def bound(self) -> bool:
        return self._inner is not None

    def bind(self, inner: dist.ProcessGroup, ranks: Sequence[int]) -> None:
        """Route to ``inner`` (of ``ranks``, global ranks in group-rank order) from now on, and register
        this object where torch looks groups up: by name (functional collectives, DTensor) and by object
        (``get_rank(group)``). Destroying the default group clears both: redone at every formation."""
        if inner.size() != self.size() or inner.rank() != self.rank():
            raise ValueError(f"{self._name}: group of rank {inner.rank()}/{inner.size()} for a mesh group "
                             f"of rank {self.rank()}/{self.size()}")
        self._inner = inner
        pg.record_group(self, ranks, inner)  # get_rank(group), get_backend(group): as for the groups torch makes
        self.register()

    def register(self) -> None:
        """Where a mesh looks its groups up (by name): :func:`hp.core.pg.register_by_name`."""
        pg.register_by_name(self._name, self)

    def unbind(self) -> None:
        """Forget the generation's group (before it is destroyed: nothing here may keep it alive)."""
        self._inner = None



# every collective of torch.distributed.ProcessGroup, forwarded to the bound group
FORWARDED = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
             "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
             "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_single",
             "reduce_scatter_single_coalesced", "broadcast", "reduce", "gather", "scatter", "alltoall",
             "alltoall_base", "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "recv_anysource")


def _forward(op: str) -> Callable[..., Any]:
    def call(self: StableGroup, *args: Any, **kwargs: Any) -> Any:
        if self._before is not None:
            self._before(op)
        if self._inner is None:
            return _unbound(self, op)
        # no local name for the inner group: a failed call's frames (kept by its traceback) must not hold
        # it, or destroying it would not close its sockets (group.py)
        return getattr(self._inner, op)(*args, **kwargs)

    call.__name__ = call.__qualname__ = op
    return call


for _op in FORWARDED:
    setattr(StableGroup, _op, _forward(_op))
del _op


class GenerationMesh:
    """This rank's :class:`DeviceMesh` over :class:`StableGroup` s, and the binding of those groups to
    each generation's process groups."""

    def __init__(self, layout: MeshLayout, rank: int, device_type: str,
                 before: Callable[[str], None] | None = None) -> None:
        self.layout, self.rank = layout, rank
        coords = layout.coords(rank)
        self.groups = [StableGroup(c, size, f"hp-mesh-{name}", before)
                       for c, size, name in zip(coords, layout.sizes, layout.names)]
        # what DeviceMesh.from_group does, with this rank given: no default group exists yet (the first
        # generation forms after the model is sharded on this mesh and registered)
        self.device_mesh = pg.device_mesh_of(device_type, torch.tensor(layout.grid(), dtype=torch.int),
                                             layout.names, self.groups, rank)
        for group in self.groups:  # FSDP asks the mesh for its groups (their rank and size) before any generation
            group.register()

    def owns(self, mesh: DeviceMesh) -> bool:
        """Whether ``mesh`` (a DTensor's, say) is this one or a sub-mesh of it."""
        try:
            groups = mesh.get_all_groups()
        except RuntimeError:
            return False
        return bool(groups) and all(any(g is mine for mine in self.groups) for g in groups)

    @property
    def shard_coordinate(self) -> int:
        """Which shard this process holds: its coordinate along ``shard``, fixed when FSDP sharded the model."""
        return self.groups[-1].rank()

    def form(self, transport: Any, rank: int, world_size: int, timeout: timedelta,
             connect_timeout: timedelta | None) -> None:
        """Bind every dimension to a group of the current generation (its default group must exist), where
        this process is ``rank`` of ``world_size``. Every rank forms its dimensions in the same order, so the
        members of a group meet. An elastic HSDP job re-forms with whole replica groups more or fewer (the
        controller renumbers ranks by whole units): the shard groups stay as they are, the replicate groups
        grow or shrink. Any other change loses shards: a rank's FSDP shard is the one its coordinate along
        ``shard`` had when the model was sharded."""
        layout = self.layout.resized(world_size)
        if layout is None:  # the shards live on a mesh of that shape: no peer holds others
            raise ShardLost(f"generation of {world_size} ranks for a device mesh of {self.layout.sizes}: only an "
                            f"HSDP mesh changes its world size, by whole replica groups of {self.layout.sizes[-1]} (the "
                            f"scaling policy's unit must be a multiple of the shard group size {self.layout.sizes[-1]})")
        coords = layout.coords(rank)
        if coords[-1] != self.shard_coordinate:
            raise ShardLost(f"rank {rank} of {world_size} is shard {coords[-1]} of a mesh of {layout.sizes}; this "
                            f"process holds shard {self.shard_coordinate} (the scaling policy's unit must be a "
                            f"multiple of the shard group size {layout.sizes[-1]})")
        self.layout, self.rank = layout, rank
        for dim, group in enumerate(self.groups):
            ranks = layout.group_ranks(rank, dim)
            if (group.rank(), group.size()) != (coords[dim], layout.sizes[dim]):
                group.resize(coords[dim], layout.sizes[dim])
            inner = dist.group.WORLD if len(ranks) == world_size else transport.new_subgroup(
                ranks, timeout=timeout, connect_timeout=connect_timeout)
            group.bind(inner, ranks)

    def release(self) -> None:
        for group in self.groups:
            group.unbind()

"""Sharded optimizer state (ZeRO-1: torch's ``ZeroRedundancyOptimizer``) that survives a lost rank.

With ZeRO each rank holds the optimizer state of one partition of the parameters only, so no peer
can hand a replacement "the" state the way DDP replicas can. After every committed step each rank
copies its shard (partition parameters + local optimizer state) to its **buddy**, the next rank in
the partitioning's **ring**, which keeps it in CPU memory (:mod:`hp.checkpointless.replicas`).

A step's tail is: vote → local shard step → scheduler → *committed* → parameter sync → replication.
Everything up to "committed" is local and cannot be stopped by a peer, so a survivor's own shard is
always at its committed step. A peer dying in the tail leaves its buddy's replica one step old: the
buddy then still holds that step's averaged gradients (it never got past the step), so the
replacement **rolls forward**: it loads the old shard and re-runs the same local optimizer step with
the same gradients and hyper-parameters, which gives the same bits. A shard whose owner and buddy
are both lost cannot be rebuilt from peers: :class:`ShardLost` says so (the job-level rung of the
recovery ladder, a tiered checkpoint, is where that goes).

When the world size changes (elastic shrink and grow), :meth:`ShardedOptimizer.rebind` re-partitions
the optimizer for the new world and keeps the shard it held as :attr:`ShardedOptimizer.previous`, with
the replica of its ward in that old partitioning, until :mod:`hp.checkpointless.reshard` has moved
their state to the new owners.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from hp.checkpointless import state, transfer
from hp.checkpointless.replicas import (NO_REPLICA, Replicas, buddy_in, check_ring, identity, node_ring,  # noqa: F401
                                        ward_in)


# ---- the ZeRO seam ---------------------------------------------------------------------------------
# The one place in hp that touches ZeroRedundancyOptimizer's privates (packages/hp-core/tests/test_pg.py
# checks; torch's process-group privates are hp.core.pg's). ZeRO's public API is a whole ``step()``: no
# public way splits the local update from its parameter broadcast, re-partitions for another world, gives
# another rank's partition or builds a local optimizer like its own. Checked against torch 2.13.0
# (torch/distributed/optim/zero_redundancy_optimizer.py); each function names the private it uses.
def zero_overlaps_ddp(zero: ZeroRedundancyOptimizer) -> bool:
    return zero._overlap_with_ddp  # overlap_with_ddp=True, no public getter


def zero_partition(zero: ZeroRedundancyOptimizer, rank: int) -> list[torch.Tensor]:
    """``rank``'s parameters in its local optimizer's order at ZeRO's current world size (cached)."""
    return [p for g in zero._partition_parameters()[rank] for p in g["params"]]


def zero_forget_partitioning(zero: ZeroRedundancyOptimizer) -> None:
    zero._clear_cache()  # after ``world_size`` or ``rank`` changed


def zero_local_step(zero: ZeroRedundancyOptimizer) -> None:
    """``zero.step()``'s local update without its parameter broadcast, and what the LR scheduler's wrapper
    of ``zero.step()`` would record: the split step counts as one."""
    zero._local_step()
    zero._opt_called = True


def zero_repartition(zero: ZeroRedundancyOptimizer, new_local_optimizer: bool) -> None:
    """After ``world_size`` or ``rank`` changed: a local optimizer without state (unless the caller put one
    back) and the parameter buckets (a no-op unless ``parameters_as_bucket_view=True``)."""
    if new_local_optimizer:
        zero._init_local_optimizer()
    zero._build_param_buckets()


def zero_sync_param_groups(zero: ZeroRedundancyOptimizer, src: Sequence[dict], dst: Sequence[dict]) -> None:
    zero._sync_param_groups(src, dst)  # hyper-parameters, as ZeRO keeps its groups and its local optimizer's


def zero_like_local_optimizer(zero: ZeroRedundancyOptimizer, param_groups: list[dict]) -> torch.optim.Optimizer:
    return zero._optim_constructor(param_groups, **zero._optim_defaults)  # the local optimizer's class, defaults


class ShardLost(RuntimeError):
    """No live peer holds a copy of a rank's shard (optimizer or FSDP): in-process recovery cannot go on."""


@dataclass(frozen=True)
class Versions:
    """What every rank reports after re-forming (indexed by rank)."""

    committed: list[int]
    shard: list[int]  # step the rank's own shard is at (-1: no state, e.g. a fresh process)
    replica: list[int]  # step of the copy it holds of its ward's shard (ward: the previous rank in the ring; NO_REPLICA: none)
    grads: list[int]  # step whose averaged gradients it still holds (-1: none)


def hyper(groups: Sequence[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def set_hyper(groups: Sequence[dict], hyper: Sequence[dict]) -> None:
    if len(groups) != len(hyper):
        raise state.StateTransferError(f"peer sent {len(hyper)} parameter groups, this optimizer has {len(groups)}")
    for g, h in zip(groups, hyper):
        g.update(h)


def _step(optim: torch.optim.Optimizer, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
          step_hyper: Sequence[dict]) -> None:
    """One update of ``optim`` over ``params`` with a past step's gradients and hyper-parameters."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    set_hyper(optim.param_groups, step_hyper)
    optim.step()
    for p in params:
        p.grad = None


@dataclass(frozen=True)
class Previous:
    """The shard a rank held before its optimizer was re-partitioned for another rank or world size."""

    rank: int
    world: int
    optim: torch.optim.Optimizer  # ZeRO's local optimizer over that partition (it keeps the shard's state)
    ring: tuple[int, ...]  # the replication ring of that partitioning (its replicas were made with it)


class ShardedOptimizer:
    """The recovery side of one ``ZeroRedundancyOptimizer``; the training loop keeps using ``zero``."""

    def __init__(self, zero: ZeroRedundancyOptimizer, trainable: Sequence[torch.Tensor]) -> None:
        if zero_overlaps_ddp(zero):
            raise NotImplementedError("hp.checkpointless: ZeroRedundancyOptimizer(overlap_with_ddp=True) is not "
                                      "supported (hp does the gradient all-reduce itself; there is no DDP)")
        self.zero = zero
        self.version = -1  # step the own shard is at
        self.replicas = Replicas()  # the ward's shard
        self.previous: Previous | None = None  # set by a re-partitioning rebind until the reshard is done
        self._ring: tuple[int, ...] | None = None  # replication ring of the current partitioning (None: identity)
        self._gather: torch.Tensor | None = None  # every rank's partition, flat, padded to the longest
        self._gather_in: torch.Tensor | None = None
        self._gather_rows: list[torch.Tensor] = []
        # where each parameter's gradient lives in the runtime's flat gradient buffer
        self._grad_slices: dict[int, tuple[int, int]] = {}
        offset = 0
        for p in trainable:
            self._grad_slices[id(p)] = (offset, p.numel())
            offset += p.numel()

    @property
    def world_size(self) -> int:
        return self.zero.world_size

    @property
    def replica(self) -> dict | None:
        """The ward's shard (views into the active buffer of :attr:`replicas`)."""
        return self.replicas.held

    @property
    def replica_version(self) -> int:
        return self.replicas.version

    @property
    def ring(self) -> tuple[int, ...]:
        """The replication ring of the current partitioning (buddy: next, ward: previous)."""
        return self._ring if self._ring is not None else identity(self.world_size)

    def set_ring(self, ring: Sequence[int]) -> None:
        """The ring the current partitioning replicates along (the same on every rank: from the agreement)."""
        self._ring = check_ring(ring, self.world_size)

    @property
    def held_ring(self) -> tuple[int, ...]:
        """The ring of the partitioning the held shard and replica belong to (see :attr:`partition`)."""
        return self._held().ring

    def buddy(self, rank: int) -> int:
        return buddy_in(self.ring, rank)

    def ward(self, rank: int) -> int:
        return ward_in(self.ring, rank)

    @property
    def partition(self) -> tuple[int, int]:
        """(rank, world size) of the partitioning the held shard and replica belong to: what a re-form
        reports (after a re-partitioning :meth:`rebind`, the old one until the reshard is done)."""
        held = self._held()
        return held.rank, held.world

    def _held(self) -> Previous:
        if self.previous is not None:
            return self.previous
        return Previous(self.zero.rank, self.zero.world_size, self.zero.optim, self.ring)

    def _params_of(self, rank: int) -> list[torch.Tensor]:
        return zero_partition(self.zero, rank)

    def partitioning(self, world: int) -> list[list[torch.Tensor]]:
        """Each rank's parameters, in its local optimizer's order, as torch partitions them for ``world``."""
        zero = self.zero
        if world == zero.world_size:
            return [self._params_of(r) for r in range(world)]
        current, zero.world_size = zero.world_size, world
        zero_forget_partitioning(zero)
        try:
            return [self._params_of(r) for r in range(world)]
        finally:
            zero.world_size = current
            zero_forget_partitioning(zero)

    # ---- the step -----------------------------------------------------------------------
    def local_step(self, step: int) -> None:
        """This rank's shard of the optimizer step (no communication)."""
        zero_local_step(self.zero)
        self.version = step

    def sync_params(self) -> None:
        """Every owner's updated partition to every rank, in ONE synchronous all-gather of flat buffers.

        Not ``zero._sync_params()``: it queues one async broadcast per parameter, and after a peer dies
        the queued ones keep gloo's worker threads blocked on live peers, so destroying the group waits
        for the 60 s timeout instead of releasing everyone at once."""
        world, rank = self.world_size, self.zero.rank
        parts = [self._params_of(r) for r in range(world)]
        longest = max(sum(p.numel() for p in ps) for ps in parts)
        dtype = parts[rank][0].dtype if parts[rank] else next(p for ps in parts for p in ps).dtype
        if self._gather is None or self._gather.shape != (world, longest) or self._gather.dtype != dtype:
            # kept referenced between steps: see group.py
            device = parts[rank][0].device if parts[rank] else next(p for ps in parts for p in ps).device
            self._gather = torch.zeros(world, longest, dtype=dtype, device=device)
            self._gather_in = torch.zeros(longest, dtype=dtype, device=device)
            self._gather_rows = list(self._gather.unbind(0))
        offset = 0
        for p in parts[rank]:
            self._gather_in[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
        dist.all_gather(self._gather_rows, self._gather_in)
        with torch.no_grad():
            for r, ps in enumerate(parts):
                if r == rank:
                    continue
                offset = 0
                for p in ps:
                    p.copy_(self._gather[r, offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def rebind(self, rank: int, world_size: int) -> None:
        """Point the optimizer at the process group of a new generation. Another rank or world size
        re-partitions it (torch's partitioning for that world, a local optimizer without state); the
        shard held so far stays :attr:`previous` until the reshard has moved its state, and comes back
        as the local optimizer if a later re-form returns to its partitioning before that."""
        zero = self.zero
        zero.process_group = dist.group.WORLD
        if (zero.rank, zero.world_size) == (rank, world_size):
            return
        if self.previous is None and self.version >= 0:
            self.previous = Previous(zero.rank, zero.world_size, zero.optim, self.ring)
        zero.rank = zero.global_rank = rank  # the group is the default one: group rank = global rank
        zero.world_size = world_size
        zero_forget_partitioning(zero)
        back = self.previous is not None and (self.previous.rank, self.previous.world) == (rank, world_size)
        if back:
            zero.optim, self._ring, self.previous = self.previous.optim, self.previous.ring, None
        else:
            self._ring = None  # a new partitioning: the identity until the agreement sets its ring
        zero_repartition(zero, new_local_optimizer=not back)

    def unbind(self) -> None:
        """Drop the reference to a failed group, so that destroying it really closes its sockets
        (peers blocked in one of its collectives are released only then)."""
        self.zero.process_group = None

    # ---- shards -------------------------------------------------------------------------
    def shard(self) -> dict:
        """This rank's shard as live tensors (valid as a send payload, not as a receive template)."""
        return {"version": self.version, "params": [p.detach() for p in self._params_of(self.zero.rank)],
                "optim": self.zero.optim.state_dict()}

    def load_shard(self, shard: dict) -> None:
        params = self._params_of(self.zero.rank)
        if len(shard["params"]) != len(params):
            raise state.StateTransferError(f"shard has {len(shard['params'])} parameters, partition has {len(params)}")
        with torch.no_grad():
            for p, src in zip(params, shard["params"]):
                if p.shape != src.shape or p.dtype != src.dtype:
                    raise state.StateTransferError(f"shard parameter {list(src.shape)} {src.dtype} does not fit "
                                                   f"{list(p.shape)} {p.dtype}")
                p.copy_(src)
        # the received tensors come from a buffer of their own (never reused), so the optimizer may keep them
        self.zero.optim.load_state_dict(shard["optim"])
        self.version = int(shard["version"])
        self.previous = None  # the held shard is now this one, of the current partitioning

    def grads_of(self, params: Sequence[torch.Tensor], flat_grads: torch.Tensor) -> list[torch.Tensor | None]:
        """Views of ``params``' gradients in the runtime's flat buffer (None: a parameter without one)."""
        out: list[torch.Tensor | None] = []
        for p in params:
            offset, n = self._grad_slices.get(id(p), (0, -1))
            out.append(flat_grads[offset:offset + n].view_as(p) if n >= 0 else None)
        return out

    def roll_forward(self, step: int, grads: Sequence[torch.Tensor | None], step_hyper: Sequence[dict]) -> None:
        """Re-run step ``step``'s local update of this shard with that step's gradients and hyper-parameters."""
        _step(self.zero.optim, self._params_of(self.zero.rank), grads, step_hyper)
        zero_sync_param_groups(self.zero, self.zero.optim.param_groups, self.zero.param_groups)
        self.version = step

    # ---- resharding (elastic) -----------------------------------------------------------------
    def roll_held_forward(self, step: int, flat_grads: torch.Tensor) -> None:
        """A survivor that missed the vote of ``step``: its held shard's update of that step (its own
        scheduler has not stepped, so its hyper-parameters are that step's)."""
        held = self._held()
        params = self.partitioning(held.world)[held.rank]
        _step(held.optim, params, self.grads_of(params, flat_grads), hyper(self.zero.param_groups))
        self.version = step

    def held_shard(self) -> tuple[list[torch.Tensor], list[dict]]:
        """The held shard: its partition's parameters and their optimizer states (live, not copies)."""
        held = self._held()
        params = self.partitioning(held.world)[held.rank]
        return [p.detach() for p in params], [held.optim.state.get(p, {}) for p in params]

    def ward_shard(self, step: int, flat_grads: torch.Tensor | None) -> tuple[list[torch.Tensor], list[dict], bool]:
        """The ward's shard (held partitioning and its ring) at ``step``: copies of the replica, rolled
        forward by a local optimizer of their own when one step old. Returns (parameters, their states, rolled)."""
        held = self._held()
        params = self.partitioning(held.world)[ward_in(held.ring, held.rank)]
        skeleton, tensors = state.flatten(self.replica)
        copy = state.unflatten(skeleton, [t.clone() for t in tensors])  # the replica stays intact for a retry
        values, optim_state = copy["params"], copy["optim"]
        if len(values) != len(params):
            raise state.StateTransferError(f"replica has {len(values)} parameters, its partition has {len(params)}")
        values = [v.to(p.device) for v, p in zip(values, params)]  # replicas live in host memory
        if self.replica_version == step:
            return values, [optim_state["state"].get(i, {}) for i in range(len(values))], False
        assert flat_grads is not None and self.replica_version == step - 1  # guaranteed by plan_shard_sources
        optim = zero_like_local_optimizer(self.zero, [{"params": [values[i] for i in g["params"]]}
                                                      for g in optim_state["param_groups"]])
        optim.load_state_dict(optim_state)
        # the held optimizer ran `step` (or was just rolled forward to it): its groups hold that step's hyper-parameters
        _step(optim, values, self.grads_of(params, flat_grads), hyper(held.optim.param_groups))
        return values, [optim.state.get(v, {}) for v in values], True

    def adopt(self, states: dict[torch.Tensor, dict], version: int) -> None:
        """Install the optimizer states of this rank's new partition (keyed by parameter), at ``version``;
        the previous shard and the replica (of the old partitioning) are dropped."""
        optim = self.zero.optim
        params = [p for g in optim.param_groups for p in g["params"]]
        loaded = optim.state_dict()
        loaded["state"] = {i: states[p] for i, p in enumerate(params) if states.get(p)}
        optim.load_state_dict(loaded)  # keeps the tensors: received into buffers of their own, or the held shard's
        zero_sync_param_groups(self.zero, self.zero.param_groups, optim.param_groups)
        self.previous, self.version = None, version
        self.replicas.drop()

    # ---- replicas -----------------------------------------------------------------------
    def replicate(self, rank: int, move: Callable[[Callable[[], None]], None]) -> None:
        """Ring exchange: send the own shard to the buddy, keep the ward's (:class:`Replicas`)."""
        if self.world_size >= 2:
            self.replicas.exchange(self.ring, rank, self.shard, move)

    def send_for_replacement(self, dst: int, v: Versions, newest: int, flat_grads: torch.Tensor | None) -> None:
        """Buddy side: hand the ward's shard to its replacement, with what it needs to roll forward."""
        message: dict[str, Any] = {"shard": self.replica, "grads": None, "hyper": None}
        if self.replica_version < newest:
            assert flat_grads is not None  # guaranteed by plan_shard_sources
            message["grads"] = self.grads_of(self._params_of(dst), flat_grads)
            message["hyper"] = hyper(self.zero.optim.param_groups)
        transfer.send_state(message, dst)

    def receive_as_replacement(self, src: int, newest: int) -> bool:
        """Replacement side; returns whether the shard had to be rolled forward."""
        message = transfer.recv_state(src)  # a fresh buffer: the optimizer keeps its tensors
        self.load_shard(message["shard"])
        if self.version == newest:
            return False
        if self.version != newest - 1 or message["grads"] is None:
            raise state.StateTransferError(f"buddy rank {src} sent a shard of step {self.version} "
                                           f"without what it takes to bring it to step {newest}")
        self.roll_forward(newest, message["grads"], message["hyper"])
        return True


def plan_shard_sources(v: Versions, newest: int, ring: Sequence[int] = ()) -> dict[int, int]:
    """For each rank whose shard is not at ``newest`` and cannot roll forward by itself, the buddy that
    rebuilds it: the next rank in ``ring``, the ring the replicas were made with (() : the identity).
    Raises :class:`ShardLost` (on every rank alike) when no peer can."""
    world = len(v.committed)
    ring = check_ring(ring, world)
    sources: dict[int, int] = {}
    for r in range(world):
        if v.shard[r] == newest or (v.shard[r] == newest - 1 and v.grads[r] == newest):
            continue  # up to date, or a survivor that missed the vote and re-runs its own update
        b = buddy_in(ring, r)
        usable = v.shard[b] >= 0 and (v.replica[b] == newest or (v.replica[b] == newest - 1 and v.grads[b] == newest))
        if world < 2 or not usable:
            raise ShardLost(
                f"the optimizer shard of rank {r} at step {newest} is lost: its buddy rank {b} holds "
                f"{'nothing' if v.shard[b] < 0 else f'a copy of step {v.replica[b]}'}; no peer can rebuild it "
                f"(restart the job from a checkpoint)")
        sources[r] = b
    return sources


def own_roll_forward_needed(v: Versions, rank: int, newest: int) -> bool:
    return v.shard[rank] == newest - 1 and v.grads[rank] == newest

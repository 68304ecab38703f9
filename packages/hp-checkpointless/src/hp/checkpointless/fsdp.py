"""FSDP2 and HSDP state that survives a lost rank: a model sharded with ``fully_shard`` on hp's mesh.

With FSDP2 every rank holds one shard of the parameters and of the optimizer state (DTensors on the
mesh of :mod:`hp.checkpointless.mesh`); the gradient reduction (reduce-scatter over the shard group,
and for HSDP an all-reduce over the replicate group) runs inside ``backward()``. The step transaction
keeps its shape: FSDP's reductions happen before the vote (a failure in one raises out of backward and
the step is replayed after ``reset_iter_state()``), the optimizer step is local and comes after it.

Where a lost rank's shard comes from, without storage:

* **HSDP** (replicate × shard): every shard exists once per replica group. A replacement copies its
  shard (parameters and optimizer state, as local tensors) from a rank of its replicate group.
* **FSDP** (one replica group): each rank's buddy (the next rank of a ring, :mod:`hp.checkpointless.replicas`,
  the mechanism ZeRO-1's shards use) keeps a **shadow** of its shard (:mod:`hp.checkpointless.shadow`):
  a whole copy after a formation, then, every step, the ward's reduced gradients of its shard, sent
  after backward and **before the vote** (the vote covers them), which the buddy applies to the shadow
  with the ward's optimizer once the step is committed. A replacement loads the shadow's shard, rolled
  forward with the pending gradients and that step's hyper-parameters when the buddy had not applied
  them (it missed the vote): the same optimizer code on the same inputs, the same bits. (ZeRO-1 copies
  the whole shard after the commit and rolls forward with the buddy's own gradients: every ZeRO rank
  holds all of them, an FSDP rank only its shard's.)

A survivor that missed the vote of the newest step but finished its backward rolls its own shard
forward the same way. Everything else a replacement lacks (buffers, RNG, scheduler, extras) comes from
the lowest up-to-date rank, as for ZeRO (:meth:`hp.checkpointless.registry.TrainingState.replicated_part`).
Which rank sends what is :func:`plan_sources`, pure and the same on every rank; whether the shadows
must be copied whole again, :func:`stale_shadows`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp.checkpointless import state, transfer
from hp.checkpointless.mesh import GenerationMesh, MeshLayout
from hp.checkpointless.replicas import NO_REPLICA, Replicas, buddy_in, check_ring, ring_exchange, ward_in
from hp.checkpointless.shadow import Shadow
from hp.checkpointless.sharded import ShardLost, hyper, set_hyper
from hp.core.errors import UsageError


def local(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local tensor (a view, not a copy)."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local(v) for v in obj)
    return obj


@dataclass(frozen=True)
class ShardVersions:
    """What every rank reports after re-forming (indexed by rank)."""

    shard: list[int]  # step its own shard is at (-1: none, a fresh process)
    grads: list[int]  # step whose reduced gradients of its shard it holds (-1: none)
    replica_at: list[int]  # step of the ward's shard it holds (NO_REPLICA: none)
    replica_grads: list[int]  # step whose gradients came with that copy (-1: none)


def plan_sources(v: ShardVersions, newest: int, layout: MeshLayout, ring: Sequence[int] = ()) -> tuple[
        set[int], dict[int, tuple[int, bool]]]:
    """Returns (the ranks that roll their own shard forward to ``newest``, {rank: (the rank that sends
    it its shard, whether it rolls that shard forward)}) for every other rank whose shard is not at
    ``newest``. Raises :class:`ShardLost` (on every rank alike) when no live peer holds a shard."""
    world = layout.world
    ring = check_ring(ring, world)
    rolls = {r for r in range(world) if v.shard[r] == newest - 1 and v.grads[r] == newest}
    current = {r for r in range(world) if v.shard[r] == newest} | rolls
    sources: dict[int, tuple[int, bool]] = {}
    for r in range(world):
        if r in current:
            continue
        holders = [h for h in layout.holders(r) if h in current]
        if holders:
            sources[r] = (min(holders), False)
            continue
        if layout.replicas == 1 and world > 1:
            b = buddy_in(ring, r)
            if v.shard[b] >= 0 and v.replica_at[b] == newest:
                sources[r] = (b, False)
                continue
            if v.shard[b] >= 0 and v.replica_at[b] == newest - 1 != NO_REPLICA and v.replica_grads[b] == newest:
                sources[r] = (b, True)
                continue
            held = "nothing" if v.shard[b] < 0 or v.replica_at[b] == NO_REPLICA else \
                f"a copy of step {v.replica_at[b]} with the gradients of step {v.replica_grads[b]}"
            raise ShardLost(f"the FSDP shard of rank {r} at step {newest} is lost: its buddy rank {b} holds "
                            f"{held}; no peer can rebuild it (restart the job from a checkpoint)")
        raise ShardLost(f"the HSDP shard of rank {r} at step {newest} is lost: no rank of its replicate group "
                        f"{layout.holders(r)} holds it (restart the job from a checkpoint)")
    return rolls, sources


def stale_shadows(v: ShardVersions, newest: int, ring_kept: bool = True) -> list[int]:
    """Pure FSDP: the ranks whose shadow of their ward is missing (a fresh process) or cannot be brought to
    ``newest`` (one step behind without that step's gradients); each gets its ward's shard copied whole. A
    shadow at ``newest``, or one step behind with the gradients that bring it there, is kept: it is the
    ward's committed shard (a replacement's shard *is* its buddy's shadow, or a copy of it). Every rank
    when the ring changed (``ring_kept`` false): a kept shadow may be of a rank that is no longer the ward."""
    return [r for r, (at, g) in enumerate(zip(v.replica_at, v.replica_grads))
            if not ring_kept or at == NO_REPLICA or not (at == newest or (at == newest - 1 and g == newest))]


class ShardedModel:
    """The recovery side of a model sharded with FSDP2 on hp's :class:`GenerationMesh`."""

    def __init__(self, model: torch.nn.Module, mesh: GenerationMesh) -> None:
        if not hasattr(model, "reset_iter_state"):
            raise UsageError("hp needs FSDPModule.reset_iter_state() to replay a step of an FSDP2 model: "
                             f"torch {torch.__version__} has none")
        self.model, self.mesh = model, mesh
        self.params = [p for p in model.parameters() if p.requires_grad]
        strays = [n for n, p in model.named_parameters() if not isinstance(p, DTensor) or not mesh.owns(p.device_mesh)]
        if strays:
            raise UsageError(f"with ctx.device_mesh(), shard every parameter on it (fully_shard(module, "
                             f"mesh=mesh)); not sharded on it: {', '.join(strays[:5])}")
        self.version = -1  # the step this rank's shard is at (-1: a fresh process, before its first commit)
        self.ring: tuple[int, ...] = ()  # the replication ring (pure FSDP): the identity until agreed
        self.grads_in = Replicas()  # pure FSDP: the ward's reduced gradients of the last step
        self.shadow: Shadow | None = None  # pure FSDP: the ward's shard, kept at the committed step
        self.skipped = -1  # the newest committed step whose update the job skipped (a GradScaler saw inf/NaN)

    @property
    def buddies(self) -> bool:
        """Pure FSDP over several ranks: each shard's only other copy is its buddy's shadow. Follows the
        mesh's current layout: an elastic HSDP job left with one replica group has buddies from then on."""
        layout = self.mesh.layout
        return layout.replicas == 1 and layout.world > 1

    @property
    def replica_at(self) -> int:
        return NO_REPLICA if self.shadow is None or not self.buddies else self.shadow.at

    @property
    def replica_grads(self) -> int:
        pending = self._pending()
        return -1 if pending is None else int(pending["version"])

    def _pending(self) -> dict | None:
        """The ward's gradients of the step after the shadow's (that step not re-run on it yet)."""
        held = self.grads_in.held if self.buddies else None
        return held if held is not None and self.shadow is not None and int(held["version"]) == self.shadow.at + 1 \
            else None

    # ---- the step ---------------------------------------------------------------------------
    def reset(self) -> None:
        """A step failed midway: FSDP forgets its in-flight all-gathers and reductions (torch's own
        recovery entry point) and re-registers the sharded parameters. torch 2.13's reset keeps the
        gradients autograd had already accumulated on *unsharded* parameters whose group's post-backward
        had not run (the root's until the end of backward): the replay would add its own to them (seen:
        every rank off the reference from the replayed step's update on). They are dropped here, through
        FSDP's internals: no public API reaches them. A model that never ran a forward in this process (a
        replacement whose first step failed, e.g. when another rank died during its hydration) has nothing
        in flight, and torch's reset would fail on its communication state, not created until that forward
        (seen: AttributeError 'FSDPCommContext' object has no attribute 'all_gather_state')."""
        if self.model._get_fsdp_state()._is_root is not None:  # set by FSDP's lazy init at the first forward
            self.model.reset_iter_state()
        for module in self.model.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            for group in getattr(get_state(), "_fsdp_param_groups", ()) if get_state is not None else ():
                for fsdp_param in group.fsdp_params:
                    if hasattr(fsdp_param, "_unsharded_param"):
                        fsdp_param._unsharded_param.grad = None
                    fsdp_param.unsharded_accumulated_grad = None

    def clear_grads(self) -> None:
        """A step (or its replay) starts: FSDP accumulates into existing gradients, so there are none."""
        for p in self.params:
            p.grad = None

    def finite_grads(self) -> bool:
        """Whether every reduced gradient of this rank's shard is finite (one host sync, not one a parameter)."""
        checks = [torch.isfinite(p.grad.to_local()).all() for p in self.params if p.grad is not None]
        return bool(torch.stack(checks).all()) if checks else True

    def scale_grads(self, factor: float) -> None:
        """Multiply this rank's reduced gradients of its shard by ``factor`` (in place, local tensors)."""
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.to_local().mul_(factor)

    def send_gradients(self, rank: int, optimizer: torch.optim.Optimizer, step: int,
                       move: Callable[[Callable[[], None]], None]) -> None:
        """Pure FSDP, before the vote: this rank's reduced gradients of ``step`` and the step's
        hyper-parameters to its buddy; keeps its ward's."""
        if self.buddies:
            self.grads_in.exchange(self._ring(), rank, lambda: {
                "version": step, "grads": [local(p.grad) for p in self.params], "hyper": hyper(optimizer.param_groups)},
                move)

    def advance_shadow(self, step: int) -> None:
        """Step ``step`` is committed: re-run the ward's update of it on the shadow (local)."""
        pending = self._pending()
        if pending is None or int(pending["version"]) != step:
            return
        try:
            with transfer.from_peer(ward_in(self._ring(), dist.get_rank()), "gradient copy"):
                self.shadow.advance(step, pending["grads"], pending["hyper"], skip=self.skipped == step)
        except state.StateTransferError:  # the step stands (committed); the next formation copies the shard whole
            self.shadow = None

    def sync(self, rank: int, optimizer: torch.optim.Optimizer, move: Callable[[Callable[[], None]], None],
             stale: Sequence[int] | None = None) -> None:
        """Pure FSDP: a new shadow for each rank in ``stale`` (:func:`stale_shadows`; None: every rank, after
        a formation that changed who holds what), made from its ward's whole shard. Every rank calls it
        with the same ``stale``; transfers run in its order (each between the two ranks at the same item:
        no cycle of blocked sends), all at once along the ring when every shadow is stale."""
        if not self.buddies:
            return
        ring = self._ring()

        def send(buddy: int) -> None:
            transfer.send_state({"at": self.version, "shard": self.shard(optimizer),
                                 "hyper": hyper(optimizer.param_groups)}, buddy)

        def receive(ward: int) -> None:
            received = transfer.recv_state(ward)  # a fresh buffer: the shadow keeps it
            with transfer.from_peer(ward, "shard"):
                self.shadow = Shadow(received, type(optimizer))
            self.grads_in.drop()

        stale = sorted(set(range(len(ring)) if stale is None else stale))
        if len(stale) == len(ring):
            ring_exchange(ring, rank, send, receive, move)
            return
        for r in stale:
            ward = ward_in(ring, r)
            if rank == ward:
                move(lambda r=r: send(r))
            elif rank == r:
                move(lambda ward=ward: receive(ward))

    def copy_for_replacement(self, optimizer: torch.optim.Optimizer, newest: int) -> dict:
        """What this rank sends a replacement of a rank holding its shard (HSDP), or of its ward (FSDP)."""
        if self.shadow is None or not self.buddies:  # HSDP (again, after an elastic grow): its own shard
            return {"at": newest, "shard": self.shard(optimizer), "grads": None, "hyper": None}
        return self.shadow.message(self._pending())

    def _ring(self) -> tuple[int, ...]:
        return check_ring(self.ring, self.mesh.layout.world)

    # ---- shards -----------------------------------------------------------------------------
    def shard(self, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's parameters and optimizer state as local tensors (live: a send payload), and the
        optimizer's order of the parameters (``order[i]``: the index in :attr:`params` of its i-th;
        ``sizes``: its groups' lengths), which a shadow builds its optimizer with."""
        sd = optimizer.state_dict()
        position = {id(p): j for j, p in enumerate(self.params)}
        order = [position[id(p)] for g in optimizer.param_groups for p in g["params"]]
        return {"params": [p.detach().to_local() for p in self.params], "optim": local(sd["state"]),
                "order": order, "sizes": [len(g["params"]) for g in optimizer.param_groups]}

    def load_shard(self, optimizer: torch.optim.Optimizer, shard: dict, version: int) -> None:
        """Install a shard received from a peer (its tensors in a buffer of their own: kept as they are)."""
        values = shard["params"]
        if len(values) != len(self.params):
            raise state.StateTransferError(f"shard has {len(values)} parameters, this model {len(self.params)}")
        with torch.no_grad():
            for p, src in zip(self.params, values):
                mine = p.to_local()
                if mine.shape != src.shape or mine.dtype != src.dtype:
                    raise state.StateTransferError(f"shard parameter {list(src.shape)} {src.dtype} does not fit "
                                                   f"{list(mine.shape)} {mine.dtype}")
                mine.copy_(src)
        order = [p for g in optimizer.param_groups for p in g["params"]]
        states = {}
        for i, entry in shard["optim"].items():
            if not 0 <= i < len(order):
                raise state.StateTransferError(f"optimizer state for parameter {i} of {len(order)}")
            # a state shaped like the parameter's shard is one (a DTensor, as torch's optimizers make it:
            # zeros_like(param)); anything else (Adam's step count) is the parameter's own
            p, shape = order[i], order[i].to_local().shape
            states[i] = {k: self._dtensor(p, v) if isinstance(v, torch.Tensor) and v.dim() and v.shape == shape else v
                         for k, v in entry.items()}
        optimizer.load_state_dict({"state": states, "param_groups": optimizer.state_dict()["param_groups"]})
        self.version = version

    def roll_forward(self, optimizer: torch.optim.Optimizer, step: int, grads: Sequence[torch.Tensor] | None = None,
                     step_hyper: Sequence[dict] | None = None) -> None:
        """Re-run step ``step``'s optimizer update of this shard: with this rank's own reduced gradients
        (still on the parameters), or with ``grads`` (local tensors) and ``step_hyper`` from a replica; none
        when the job skipped that step (:attr:`skipped`)."""
        if step == self.skipped:
            self.clear_grads()
            self.version = step
            return
        if grads is not None:
            if len(grads) != len(self.params):
                raise state.StateTransferError(f"{len(grads)} gradients for {len(self.params)} parameters")
            for p, g in zip(self.params, grads):
                p.grad = self._dtensor(p, g.clone())
        if step_hyper is not None:
            set_hyper(optimizer.param_groups, step_hyper)
        optimizer.step()
        self.clear_grads()
        self.version = step

    @staticmethod
    def _dtensor(p: DTensor, value: torch.Tensor) -> DTensor:
        if value.shape != p.to_local().shape:
            raise state.StateTransferError(f"a shard tensor of {list(value.shape)} for a parameter whose local "
                                           f"shard is {list(p.to_local().shape)}")
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

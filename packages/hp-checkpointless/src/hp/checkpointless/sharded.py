"""Sharded optimizer state (ZeRO-1: torch's ``ZeroRedundancyOptimizer``) that survives a lost rank.

With ZeRO each rank holds the optimizer state of one partition of the parameters only, so no peer
can hand a replacement "the" state the way DDP replicas can. After every committed step each rank
copies its shard (partition parameters + local optimizer state) to its **buddy** ``(rank + 1) % W``,
which keeps it in CPU memory (two alternating buffers, so a transfer that dies midway never damages
the copy it already has).

A step's tail is: vote → local shard step → scheduler → *committed* → parameter sync → replication.
Everything up to "committed" is local and cannot be stopped by a peer, so a survivor's own shard is
always at its committed step. A peer dying in the tail leaves its buddy's replica one step old: the
buddy then still holds that step's averaged gradients (it never got past the step), so the
replacement **rolls forward**: it loads the old shard and re-runs the same local optimizer step with
the same gradients and hyper-parameters, which gives the same bits. A shard whose owner and buddy
are both lost cannot be rebuilt from peers: :class:`ShardLost` says so (the job-level rung of the
recovery ladder, a tiered checkpoint, is where that goes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from hp.checkpointless import state


class ShardLost(RuntimeError):
    """No live peer holds a copy of a rank's optimizer shard."""


@dataclass(frozen=True)
class Versions:
    """What every rank reports after re-forming (indexed by rank)."""

    committed: list[int]
    shard: list[int]  # step the rank's own shard is at (-1: no state, e.g. a fresh process)
    replica: list[int]  # step of the copy it holds of its ward's shard (ward = rank - 1)
    grads: list[int]  # step whose averaged gradients it still holds (-1: none)


def hyper(groups: Sequence[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def set_hyper(groups: Sequence[dict], hyper: Sequence[dict]) -> None:
    if len(groups) != len(hyper):
        raise state.StateTransferError(f"peer sent {len(hyper)} parameter groups, this optimizer has {len(groups)}")
    for g, h in zip(groups, hyper):
        g.update(h)


class ShardedOptimizer:
    """The recovery side of one ``ZeroRedundancyOptimizer``; the training loop keeps using ``zero``."""

    def __init__(self, zero: ZeroRedundancyOptimizer, trainable: Sequence[torch.Tensor]) -> None:
        if zero._overlap_with_ddp:
            raise NotImplementedError("hp.checkpointless: ZeroRedundancyOptimizer(overlap_with_ddp=True) is not "
                                      "supported (hp does the gradient all-reduce itself; there is no DDP)")
        self.zero = zero
        self.version = -1  # step the own shard is at
        self.replica: dict | None = None  # ward's shard (views into the active buffer)
        self.replica_version = -1
        self._buffers = [state.StateBuffer(None), state.StateBuffer(None)]
        self._gather: torch.Tensor | None = None  # every rank's partition, flat, padded to the longest
        self._gather_in: torch.Tensor | None = None
        self._gather_rows: list[torch.Tensor] = []
        self._active = 0
        # where each parameter's gradient lives in the runtime's flat gradient buffer
        self._grad_slices: dict[int, tuple[int, int]] = {}
        offset = 0
        for p in trainable:
            self._grad_slices[id(p)] = (offset, p.numel())
            offset += p.numel()

    @property
    def world_size(self) -> int:
        return self.zero.world_size

    def buddy(self, rank: int) -> int:
        return (rank + 1) % self.world_size

    def ward(self, rank: int) -> int:
        return (rank - 1) % self.world_size

    def _params_of(self, rank: int) -> list[torch.Tensor]:
        return [p for g in self.zero._partition_parameters()[rank] for p in g["params"]]

    # ---- the step -----------------------------------------------------------------------
    def local_step(self, step: int) -> None:
        """This rank's shard of the optimizer step (no communication)."""
        self.zero._local_step()
        # what the LR scheduler's wrapper of zero.step() would record: the split step counts as one
        self.zero._opt_called = True
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
            self._gather, self._gather_in = torch.zeros(world, longest, dtype=dtype), torch.zeros(longest, dtype=dtype)
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
        """Point the optimizer at the process group of a new generation (same rank, same world)."""
        if (self.zero.rank, self.zero.world_size) != (rank, world_size):
            raise NotImplementedError(
                f"ZeroRedundancyOptimizer was partitioned for rank {self.zero.rank} of {self.zero.world_size}; "
                f"re-partitioning for rank {rank} of {world_size} (elastic resizing) is not supported yet")
        self.zero.process_group = dist.group.WORLD

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

    def grads_of(self, rank: int, flat_grads: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for p in self._params_of(rank):
            offset, n = self._grad_slices[id(p)]
            out.append(flat_grads[offset:offset + n].view_as(p))
        return out

    def roll_forward(self, step: int, grads: Sequence[torch.Tensor], step_hyper: Sequence[dict]) -> None:
        """Re-run step ``step``'s local update of this shard with that step's gradients and hyper-parameters."""
        params = self._params_of(self.zero.rank)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        set_hyper(self.zero.optim.param_groups, step_hyper)
        self.zero.optim.step()
        self.zero._sync_param_groups(self.zero.optim.param_groups, self.zero.param_groups)
        for p in params:
            p.grad = None
        self.version = step

    # ---- replicas -----------------------------------------------------------------------
    def replicate(self, rank: int, move: Callable[[Callable[[], None]], None]) -> None:
        """Ring exchange: send the own shard to the buddy, keep the ward's. ``move`` runs one transfer
        (it turns transport errors into the runtime's collective errors)."""
        if self.world_size < 2:
            return
        send = lambda: state.send_state(self.shard(), self.buddy(rank))  # noqa: E731
        recv = lambda: self._receive_replica(rank)  # noqa: E731
        # even ranks send first, odd ranks receive first: no cycle of blocked sends for any world size
        for op in ((send, recv) if rank % 2 == 0 else (recv, send)):
            move(op)

    def _receive_replica(self, rank: int) -> None:
        spare = self._buffers[1 - self._active]
        received = state.recv_state(self.ward(rank), buffer=spare)
        self._active = 1 - self._active
        self.replica, self.replica_version = received, int(received["version"])

    def send_for_replacement(self, dst: int, v: Versions, newest: int, flat_grads: torch.Tensor | None) -> None:
        """Buddy side: hand the ward's shard to its replacement, with what it needs to roll forward."""
        message: dict[str, Any] = {"shard": self.replica, "grads": None, "hyper": None}
        if self.replica_version < newest:
            assert flat_grads is not None  # guaranteed by plan_shard_sources
            message["grads"] = self.grads_of(dst, flat_grads)
            message["hyper"] = hyper(self.zero.optim.param_groups)
        state.send_state(message, dst)

    def receive_as_replacement(self, src: int, newest: int) -> bool:
        """Replacement side; returns whether the shard had to be rolled forward."""
        message = state.recv_state(src)  # a fresh buffer: the optimizer keeps its tensors
        self.load_shard(message["shard"])
        if self.version == newest:
            return False
        if self.version != newest - 1 or message["grads"] is None:
            raise state.StateTransferError(f"buddy rank {src} sent a shard of step {self.version} "
                                           f"without what it takes to bring it to step {newest}")
        self.roll_forward(newest, message["grads"], message["hyper"])
        return True


def plan_shard_sources(v: Versions, newest: int) -> dict[int, int]:
    """For each rank whose shard is not at ``newest`` and cannot roll forward by itself, the buddy that
    rebuilds it. Raises :class:`ShardLost` (on every rank alike) when no peer can."""
    world = len(v.committed)
    sources: dict[int, int] = {}
    for r in range(world):
        if v.shard[r] == newest or (v.shard[r] == newest - 1 and v.grads[r] == newest):
            continue  # up to date, or a survivor that missed the vote and re-runs its own update
        b = (r + 1) % world
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

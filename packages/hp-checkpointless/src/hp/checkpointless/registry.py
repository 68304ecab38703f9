"""The training state a job registers with hp, and its last committed snapshot.

What hydration (:mod:`hp.checkpointless.hydration`), the job-level rung (:mod:`hp.checkpointless.ladder`)
and elastic resharding take: the model (replicated, or sharded with FSDP2 on hp's device mesh:
:mod:`hp.checkpointless.fsdp`), optimizer (or its factory), scheduler, AMP grad scaler,
extra state, the optional checkpoint store, and what a replayed step rolls back to: the RNG states and
the model's buffers as of the last committed step (a failed step's forward already updated BatchNorm's
running statistics; the replay must start from the committed ones).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from hp.checkpointless import fsdp, sharded, state
from hp.checkpointless.rng import capture_rng, restore_rng
from hp.core.errors import UsageError


def warm_optimizer_imports() -> None:
    """The first optimizer a process builds pays torch's lazy imports (torch._dynamo, ~0.4 s idle, 4 s
    under load): paid ahead by whatever builds its optimizer late (a factory, a hot spare that builds
    its model once it has a rank), not while a spare is being promoted."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


class TrainingState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Callable | None = None,
                 scheduler: Any = None, extra: Any = None, checkpoint: Any = None, scaler: Any = None,
                 broadcast_buffers: bool = True, mesh: Any = None) -> None:
        self.factories: tuple[Callable, Callable | None] | None = None  # built once a group exists
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            self.factories, optimizer, scheduler = (optimizer, scheduler), None, None
            warm_optimizer_imports()
        elif callable(scheduler) and not hasattr(scheduler, "state_dict"):
            raise UsageError("a scheduler factory needs an optimizer factory: pass optimizer=lambda params: ...")
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise UsageError("pass a ZeroRedundancyOptimizer as a factory (optimizer=lambda params: "
                             "ZeroRedundancyOptimizer(params, ...)): hp builds it once the process group exists")
        if scaler is not None and not all(hasattr(scaler, a) for a in ("unscale_", "step", "update", "state_dict")):
            raise UsageError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra, self.checkpoint, self.scaler = extra, checkpoint, scaler
        self.broadcast_buffers = broadcast_buffers
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sharded: sharded.ShardedOptimizer | None = None
        self.fsdp = self._sharded_model(model, mesh)
        self.committed = -1  # last committed step
        # samples the job consumed through the committed step: where the next step's samples start
        # (StepSampler). Only committed steps count, so a failed step's replay reads the same samples.
        self.samples = 0
        # the world size the state is for (what ``on_scale`` last adapted it to: an LR that follows W);
        # 0 before any group. A hydrated rank takes its source's: the state it received is for that size.
        self.world = 0
        self.receive_buffer: state.StateBuffer | None = None  # a spare's pre-faulted hydration buffer
        self.receive_shared: Any = None  # its memory, when shared with the node (hp.checkpointless.shm.SharedBuffer)
        self.premaps: Any = None  # the node's offered spare buffers (hp.checkpointless.premap.Premaps); None: none
        self.buffers = [b for _, b in model.named_buffers()]  # every buffer, in module order (read by the transaction)
        self._snapshot = state.StateBuffer(state.flatten(self.buffers)[0]) if self.buffers else None
        self.mark_committed(-1)

    @staticmethod
    def _sharded_model(model: torch.nn.Module, mesh: Any) -> fsdp.ShardedModel | None:
        """An FSDP2 model (``fully_shard`` on the mesh of ``ctx.device_mesh()``): its recovery side."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            return None
        if mesh is None:
            raise UsageError("shard the model on the mesh hp forms for each generation: "
                             "mesh = ctx.device_mesh(...); fully_shard(module, mesh=mesh)")
        return fsdp.ShardedModel(model, mesh)

    def build_optimizer(self) -> None:
        """Call the registered factories (once this process is in a process group)."""
        make_optimizer, make_scheduler = self.factories
        self.factories = None
        self.optimizer = make_optimizer(list(self.model.parameters()))
        self.scheduler = make_scheduler(self.optimizer) if make_scheduler is not None else None
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            if self.fsdp is not None:
                raise UsageError("an FSDP2 model shards its optimizer state itself: use a plain optimizer")
            if self.scaler is not None:
                raise UsageError("a GradScaler with a ZeroRedundancyOptimizer is not supported yet")
            self.sharded = sharded.ShardedOptimizer(self.optimizer, self.params)

    # ---- the committed snapshot -------------------------------------------------------------
    def mark_committed(self, step: int) -> None:
        """``step`` is committed: what a later failed step rolls back to is taken now."""
        self.committed, self.rng = step, capture_rng()
        if self.fsdp is not None:  # an FSDP rank's own shard is at its committed step, and so is its ward's shadow
            self.fsdp.version = step
            self.fsdp.advance_shadow(step)
        if self._snapshot is not None:
            self._snapshot.pack(self.buffers)

    def rollback(self) -> None:
        """Undo what a failed step did before its vote: RNG draws, buffer updates (its gradients are
        zeroed when the replay begins: see StepTransaction.begin)."""
        restore_rng(self.rng)
        if self._snapshot is not None:
            with torch.no_grad():
                for buf, saved in zip(self.buffers, self._snapshot.unpack()):
                    buf.copy_(saved)
        if self.fsdp is not None:
            self.fsdp.reset()

    # ---- what travels to a replacement ------------------------------------------------------
    def capture(self) -> dict:
        """The whole replicated state (live tensors: also a receive template)."""
        extra = self.extra.state_dict() if self.extra is not None else None
        return state.capture(self.model, self.optimizer, self.scheduler, extra=extra, scaler=self.scaler)

    def restore(self, received: dict, adopt: bool = False) -> None:
        """Load what a peer sent; ``adopt``: the received tensors are this rank's to keep (:func:`state.restore`)."""
        extra = state.restore(received, self.model, self.optimizer, self.scheduler, scaler=self.scaler, adopt=adopt)
        if self.extra is not None and extra:
            self.extra.load_state_dict(extra)

    def replicated_part(self) -> dict:
        """With a sharded optimizer: what is the same on every rank (partitions and shards travel apart)."""
        return {"buffers": dict(self.model.named_buffers()), "rng": capture_rng(),
                "hyper": sharded.hyper(self.optimizer.param_groups),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "extra": self.extra.state_dict() if self.extra is not None else None}

    def load_replicated_part(self, received: dict) -> None:
        buffers = dict(self.model.named_buffers())
        if set(buffers) != set(received["buffers"]):
            raise state.StateTransferError("the source's model buffers differ from this model's")
        with torch.no_grad():
            for name, buf in received["buffers"].items():
                buffers[name].copy_(buf)
        sharded.set_hyper(self.optimizer.param_groups, received["hyper"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(received["scheduler"])
        if self.scaler is not None:
            if not isinstance(received.get("scaler"), dict):
                raise state.StateTransferError("the source sent no GradScaler state")
            self.scaler.load_state_dict(received["scaler"])
        if self.extra is not None and received["extra"]:
            self.extra.load_state_dict(received["extra"])
        restore_rng(received["rng"])

    # ---- comparison ---------------------------------------------------------------------------
    def digests(self) -> dict[str, str | None]:
        """SHA-256 of the exact bytes of each part of the state (``final_state`` events, ``hp demo``)."""
        optimizer = self.sharded.zero.optim if self.sharded is not None else self.optimizer  # a shard: this rank's
        parts = {"params": dict(self.model.named_parameters()), "buffers": dict(self.model.named_buffers()),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        # a sharded model's parts are this rank's shards (local tensors of its DTensors)
        return {name: None if part is None else digest(fsdp.local(part)) for name, part in parts.items()}


def digest(obj: Any) -> str:
    skeleton, tensors = state.flatten(obj)
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

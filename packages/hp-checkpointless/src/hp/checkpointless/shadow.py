"""A buddy's shadow of its ward's FSDP2 shard: kept current by re-running the ward's updates.

Pure FSDP holds each shard once. Copying a rank's whole shard (parameters and optimizer state: 3× its
size with Adam) to its buddy after every step would cost a step's worth of traffic (measured: +46 % on
the 27 M GPT over gloo). Instead the buddy keeps a **shadow**: the ward's shard as plain tensors with an
optimizer of the same class over them, copied whole once (:meth:`ShardedModel.sync
<hp.checkpointless.fsdp.ShardedModel.sync>`, after a formation that changed who holds what), and then,
every step, the ward sends only that step's reduced gradients of its shard and the step's
hyper-parameters (before the vote: the vote covers them); once the step is committed the buddy re-runs
the ward's optimizer update on the shadow. The same optimizer code on the same inputs gives the same bits
as the ward's update on its DTensors (its foreach/elementwise kernels see the same local tensors).

A shadow is therefore at the committed step, or one step behind with the gradients that bring it there
(a buddy that missed the vote): what hydration sends a replacement (:meth:`Shadow.message`), which
rolls it forward when it is one step behind.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hp.checkpointless import state
from hp.checkpointless.sharded import set_hyper


class Shadow:
    """The ward's shard, from a full copy (``message``: :meth:`hp.checkpointless.fsdp.ShardedModel.full_copy`),
    its tensors adopted as they are (received into a buffer of their own)."""

    def __init__(self, message: dict, optimizer_class: type) -> None:
        shard = message["shard"]
        self.at = int(message["at"])  # the step the shadow is at
        self.params = list(shard["params"])
        self.order, self.sizes = list(shard["order"]), list(shard["sizes"])
        if sorted(self.order) != list(range(len(self.params))) or sum(self.sizes) != len(self.order):
            raise state.StateTransferError(f"a shard's optimizer order {self.order[:8]} (groups {self.sizes}) does "
                                           f"not cover its {len(self.params)} parameters")
        groups, start = [], 0
        for size, group_hyper in zip(self.sizes, message["hyper"]):
            groups.append({**group_hyper, "params": [self.params[self.order[i]] for i in range(start, start + size)]})
            start += size
        self.optimizer = optimizer_class(groups)
        blank = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": shard["optim"], "param_groups": blank["param_groups"]})

    def advance(self, step: int, grads: Sequence[torch.Tensor], step_hyper: Sequence[dict], skip: bool = False) -> None:
        """The ward's update of committed step ``step``: its reduced gradients and hyper-parameters; none
        when the job skipped the step (a GradScaler saw inf/NaN): the shadow is at ``step`` as it is."""
        if skip:
            self.at = step
            return
        if len(grads) != len(self.params):
            raise state.StateTransferError(f"{len(grads)} gradients for a shadow of {len(self.params)} parameters")
        for p, g in zip(self.params, grads):
            p.grad = g
        set_hyper(self.optimizer.param_groups, step_hyper)
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.at = step

    def message(self, pending: dict | None) -> dict:
        """What a replacement of the ward gets: the shard at :attr:`at`, with ``pending`` (the gradients
        and hyper-parameters of step ``at + 1``, when that step is committed but not re-run here)."""
        shard = {"params": self.params, "optim": self.optimizer.state_dict()["state"], "order": self.order,
                 "sizes": self.sizes}
        return {"at": self.at, "shard": shard, "grads": None if pending is None else pending["grads"],
                "hyper": None if pending is None else pending["hyper"]}

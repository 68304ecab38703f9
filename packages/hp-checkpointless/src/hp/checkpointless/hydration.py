"""Hydration after a re-form: the ranks behind the newest committed step get the state they lack.

Replicated state (DDP-style): every up-to-date rank holds all of it, the lowest one sends it whole.
Sharded optimizer state (:mod:`hp.checkpointless.sharded`): each missing shard comes from the owner's
buddy (rolled forward when one step old), the replicated rest (buffers, LR schedule, RNG, extras)
from the lowest up-to-date rank, each partition's parameters from its owner; then shards are
replicated again. Every transfer is one checksummed flat buffer (:mod:`hp.checkpointless.state`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hp.checkpointless import sharded, state
from hp.checkpointless.rng import capture_rng, restore_rng

if TYPE_CHECKING:
    from hp.checkpointless.runtime import Context


def replicated(ctx: Context, behind: list[int], source: int, newest: int, generation: int) -> None:
    """Replicated state: the ranks behind pull everything from the source."""
    if behind:
        ctx._phase(newest, "hydration")
    for r in behind:
        if ctx._rank == source:
            state.send_state(ctx._capture(), r)
        elif ctx._rank == r:
            # in place into our own tensors when the layouts match; a fresh process's optimizer
            # has no state yet, so it receives into a new buffer the optimizer then keeps
            has_state = ctx._optimizer is None or bool(ctx._optimizer.state)
            received = state.recv_state(source, template=ctx._capture() if has_state else None,
                                        buffer=None if has_state else ctx._receive_buffer)
            ctx._receive_buffer = None  # the optimizer now owns those bytes: never receive into them again
            extra = state.restore(received, ctx._model, ctx._optimizer, ctx._scheduler)
            if ctx._extra is not None and extra:
                ctx._extra.load_state_dict(extra)
            _hydrated(ctx, newest, source, generation)


def sharded_optimizer(ctx: Context, v: sharded.Versions, behind: list[int], source: int, newest: int,
                      generation: int) -> None:
    """Sharded optimizer: shards come from buddies (rolled forward where one step old), the
    replicated rest from the source, partitions from their owners; then shards are re-replicated."""
    sh = ctx._sharded
    rebuild = sharded.plan_shard_sources(v, newest)  # ShardLost: the same verdict on every rank
    if behind:
        ctx._phase(newest, "hydration")
    if sharded.own_roll_forward_needed(v, ctx._rank, newest):  # missed the vote of `newest` only
        params = [p for p in ctx._model.parameters() if p.requires_grad]
        ctx._unflatten_grads(params, ctx._grads)
        sh.local_step(newest)
        ctx._optimizer.zero_grad(set_to_none=False)
        ctx.events.record("shard_rebuilt", rank=ctx._rank, step=newest, buddy=None, rolled_forward=True,
                          generation=generation)
    for r, buddy in sorted(rebuild.items()):
        if ctx._rank == buddy:
            sh.send_for_replacement(r, v, newest, ctx._grads if ctx._grads_step == newest else None)
        elif ctx._rank == r:
            rolled = sh.receive_as_replacement(buddy, newest)
            ctx.events.record("shard_rebuilt", rank=r, step=newest, buddy=buddy, rolled_forward=rolled,
                              generation=generation)
    for r in behind:
        if ctx._rank == source:
            state.send_state(_replicated_state(ctx), r)
        elif ctx._rank == r:
            _load_replicated_state(ctx, state.recv_state(source))
            _hydrated(ctx, newest, source, generation)
    ctx._collective(sh.sync_params)
    sh.replicate(ctx._rank, ctx._collective)


def _replicated_state(ctx: Context) -> dict:
    """What is the same on every rank of a sharded job (partitions and shards travel separately)."""
    return {"buffers": dict(ctx._model.named_buffers()), "rng": capture_rng(),
            "hyper": sharded.hyper(ctx._optimizer.param_groups),
            "scheduler": ctx._scheduler.state_dict() if ctx._scheduler is not None else None,
            "extra": ctx._extra.state_dict() if ctx._extra is not None else None}


def _load_replicated_state(ctx: Context, received: dict) -> None:
    buffers = dict(ctx._model.named_buffers())
    if set(buffers) != set(received["buffers"]):
        raise state.StateTransferError("the source's model buffers differ from this model's")
    with torch.no_grad():
        for name, buf in received["buffers"].items():
            buffers[name].copy_(buf)
    sharded.set_hyper(ctx._optimizer.param_groups, received["hyper"])
    if ctx._scheduler is not None:
        ctx._scheduler.load_state_dict(received["scheduler"])
    if ctx._extra is not None and received["extra"]:
        ctx._extra.load_state_dict(received["extra"])
    restore_rng(received["rng"])


def _hydrated(ctx: Context, newest: int, source: int, generation: int) -> None:
    ctx.committed, ctx._rng = newest, capture_rng()
    ctx.events.record("hydrated", rank=ctx._rank, step=newest, source=source, generation=generation)

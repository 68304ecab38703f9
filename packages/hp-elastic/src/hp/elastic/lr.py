"""The learning rate at a new world size, with the LR scheduler kept consistent.

A policy whose LR follows the world size (``lr_rule`` linear, sqrt or table: :meth:`ScalingPolicy.lr_for`)
changes the *base* LR at a scale event. Writing the new value into ``param_groups[i]["lr"]`` alone is
undone at the scheduler's next step (a scheduler derives the LR from its ``base_lrs``) or skews it (a
chainable scheduler multiplies the current value). :func:`rescale_lr` scales both by the same factor, so
the schedule keeps its shape (warm-up, cosine, steps) at the new level and its state (``last_epoch``) is
untouched; with the ``constant`` rule (the global batch is constant) it changes nothing.
"""

from __future__ import annotations

from typing import Any

from hp.elastic.policy import ScalingPolicy


def rescale_lr(optimizer: Any, scheduler: Any, factor: float) -> None:
    """Multiply the optimizer's current LRs, their ``initial_lr`` and the scheduler's ``base_lrs`` by ``factor``."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def on_scale_lr(policy: ScalingPolicy, optimizer: Any, scheduler: Any, old_world: int, new_world: int) -> float:
    """The policy's LR change for a scale event from ``old_world`` to ``new_world``; returns the factor applied.
    Made for ``ctx.register(..., on_scale=lambda old, new: on_scale_lr(policy, ctx.optimizer, ctx.scheduler,
    old, new))``."""
    if policy.lr_rule == "constant" and not policy.overrides:
        return 1.0
    factor = policy.lr_for(new_world) / policy.lr_for(old_world)
    if factor != 1.0:
        rescale_lr(optimizer, scheduler, factor)
    return factor

"""Scaling decisions: given the policy, the world size, the capacity and an event, the target size.

Pure, like :mod:`hp.core.controller`'s recovery decisions: no clock, no I/O, no process group, so
the whole table of cases is a unit test. The runtime acts on the answer:

* ``SHRINK`` / ``GROW``: re-form at ``world`` at the next step boundary (the failed step is replayed
  with the same global batch);
* ``STAY``: keep going (e.g. capacity grew by less than the scaling unit);
* ``FALLBACK``: no allowed size fits, the job is below ``min_replicas``: escalate to the
  process-level / job-level rungs (restart with a checkpoint), as a fixed-size job would.

Capacity is the number of replicas the cluster could give the job now, counting the ones it runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hp.elastic.policy import ScalingPolicy


class ScaleAction(str, enum.Enum):
    STAY = "stay"
    SHRINK = "shrink"
    GROW = "grow"
    FALLBACK = "fallback"


@dataclass(frozen=True)
class Failure:
    """``lost`` replicas died and no hot spare is left to take their ranks."""

    lost: int = 1


@dataclass(frozen=True)
class Preemption:
    """``replicas`` replicas must leave (SIGTERM to their agent, or a request through the controller)."""

    replicas: int


@dataclass(frozen=True)
class CapacityChanged:
    """The capacity source reports a new capacity (passed to :func:`decide`); grow into it if it fits."""


Event = Failure | Preemption | CapacityChanged


@dataclass(frozen=True)
class ScaleDecision:
    action: ScaleAction
    world: int | None  # the world size to re-form at; None with FALLBACK
    idle: int  # healthy replicas left out because no allowed size uses them (unit / discrete sizes)
    reason: str


def decide(policy: ScalingPolicy, world: int, capacity: int, event: Event) -> ScaleDecision:
    """The target world size after ``event`` at ``world``, with ``capacity`` replicas available."""
    if world <= 0 or capacity < 0:
        raise ValueError(f"world must be positive and capacity non-negative, got world={world} capacity={capacity}")
    if isinstance(event, Failure):
        if not 0 < event.lost <= world:
            raise ValueError(f"a failure loses 1..{world} replicas, got {event.lost}")
        healthy, what = world - event.lost, f"{event.lost} replica(s) failed with no spare left"
    elif isinstance(event, Preemption):
        if not 0 < event.replicas <= world:
            raise ValueError(f"a preemption takes 1..{world} replicas, got {event.replicas}")
        healthy, what = world - event.replicas, f"{event.replicas} replica(s) preempted"
    elif isinstance(event, CapacityChanged):
        healthy, what = capacity, f"capacity is {capacity}"
    else:
        raise TypeError(f"unknown scaling event {event!r}")
    usable = min(healthy, capacity, policy.max_replicas)
    target = policy.largest_at_most(usable)
    if target is None:
        return ScaleDecision(ScaleAction.FALLBACK, None, 0,
                             f"{what}: {usable} usable replica(s), below the smallest allowed size "
                             f"{policy.sizes_allowed()[0]}: fall back to restart")
    idle = max(0, min(healthy, capacity) - target)
    if target == world:
        action = ScaleAction.STAY
    else:
        action = ScaleAction.GROW if target > world else ScaleAction.SHRINK
    return ScaleDecision(action, target, idle, f"{what}: {action.value} {world} -> {target}")

"""Scaling decisions, as a table: (policy, world, capacity, event) -> action, world, idle."""

from __future__ import annotations

import pytest

from hp.elastic.decide import CapacityChanged, Failure, Preemption, ScaleAction, decide
from hp.elastic.policy import ScalingPolicy

STAY, SHRINK, GROW, FALLBACK = ScaleAction.STAY, ScaleAction.SHRINK, ScaleAction.GROW, ScaleAction.FALLBACK
P1 = ScalingPolicy(min_replicas=2, max_replicas=8, global_batch=48, micro_batch=4)  # unit 1
P2 = ScalingPolicy(min_replicas=2, max_replicas=8, unit=2, global_batch=48, micro_batch=4)
PS = ScalingPolicy(min_replicas=2, max_replicas=12, sizes=[4, 8, 12], global_batch=48, micro_batch=4)


@pytest.mark.parametrize("name, policy, world, capacity, event, action, target, idle", [
    ("kill, no spare: 4 -> 3", P1, 4, 8, Failure(), SHRINK, 3, 0),
    ("two killed", P1, 4, 8, Failure(lost=2), SHRINK, 2, 0),
    ("kill at min: fall back", P1, 2, 8, Failure(), FALLBACK, None, 0),
    ("unit 2: 4 - 1 rounds to 2", P2, 4, 8, Failure(), SHRINK, 2, 1),
    ("unit 2: 6 - 1 -> 4", P2, 6, 8, Failure(), SHRINK, 4, 1),
    ("discrete: 12 - 1 -> 8", PS, 12, 12, Failure(), SHRINK, 8, 3),
    ("discrete: 4 - 1 below min size", PS, 4, 12, Failure(), FALLBACK, None, 0),
    ("capacity also shrank", P1, 6, 3, Failure(), SHRINK, 3, 0),
    ("preempt a 2-replica node", P1, 4, 8, Preemption(2), SHRINK, 2, 0),
    ("preempt below min", P1, 3, 8, Preemption(2), FALLBACK, None, 0),
    ("preempt everything", P1, 4, 8, Preemption(4), FALLBACK, None, 0),
    ("preempt, discrete", PS, 12, 12, Preemption(2), SHRINK, 8, 2),
    ("grow 3 -> 4", P1, 3, 4, CapacityChanged(), GROW, 4, 0),
    ("grow capped at max", P1, 4, 20, CapacityChanged(), GROW, 8, 12),
    ("grow by less than a unit: stay", P2, 4, 5, CapacityChanged(), STAY, 4, 1),
    ("grow, discrete 4 -> 8", PS, 4, 11, CapacityChanged(), GROW, 8, 3),
    ("capacity unchanged", P1, 4, 4, CapacityChanged(), STAY, 4, 0),
    ("capacity taken back", P1, 8, 5, CapacityChanged(), SHRINK, 5, 0),
    ("capacity below min", P1, 4, 1, CapacityChanged(), FALLBACK, None, 0),
    ("capacity zero", P1, 4, 0, CapacityChanged(), FALLBACK, None, 0),
])
def test_decide_table(name, policy, world, capacity, event, action, target, idle):
    d = decide(policy, world, capacity, event)
    assert (d.action, d.world, d.idle) == (action, target, idle), (name, d)
    assert "\n" not in d.reason


@pytest.mark.parametrize("world, capacity, event", [
    (0, 4, Failure()), (4, -1, Failure()), (4, 4, Failure(lost=5)), (4, 4, Failure(lost=0)),
    (4, 4, Preemption(0)), (4, 4, Preemption(5)),
])
def test_decide_rejects_impossible_events(world, capacity, event):
    with pytest.raises(ValueError):
        decide(P1, world, capacity, event)


def test_decide_rejects_unknown_event():
    with pytest.raises(TypeError):
        decide(P1, 4, 4, "grow")  # type: ignore[arg-type]

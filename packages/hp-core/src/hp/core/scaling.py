"""The scaling decision's contract: what the controller asks when the job's size may change.

hp-core never imports hp-elastic. The controller holds a :class:`Scaler` (from the ``hp_scaler`` hook,
:mod:`hp.core.hookspecs`) and asks it for a target world size on each scale event; hp-elastic's
implementation answers from the user's ``ScalingPolicy``. Without one a job has a fixed size.

Also here, pure and shared by the controller's handlers: :func:`renumber`, the stable renumbering of
ranks after some leave and others join. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

FAILURE, PREEMPTION, CAPACITY = "failure", "preemption", "capacity"


@dataclass(frozen=True)
class ScaleEvent:
    """``kind``: ``failure`` (``count`` ranks died with no spare left), ``preemption`` (``count`` ranks
    must leave: SIGTERM to their agent), ``capacity`` (the capacity changed, or new processes are ready)."""

    kind: str
    count: int = 0


@dataclass(frozen=True)
class ScaleTarget:
    """``world``: the size to re-form at (None: no allowed size fits: fall back to the restart rungs)."""

    world: int | None
    reason: str


@runtime_checkable
class Scaler(Protocol):
    """``unit``: world sizes are multiples of it, and ranks leave by whole units of consecutive ranks
    (1: any rank alone)."""

    min_replicas: int
    max_replicas: int
    unit: int

    def target(self, world: int, capacity: int, event: ScaleEvent) -> ScaleTarget:
        """The world size after ``event`` at ``world``, with ``capacity`` ranks the cluster can give
        the job now (counting those it runs, and the ready processes waiting to join)."""


def renumber(holders: dict[int, str], members: dict[int, int], leaving: set[int],
             joining: list[tuple[str, int]]) -> tuple[dict[int, str], dict[int, int], dict[int, int]]:
    """Ranks after ``leaving`` ranks leave and ``joining`` (holder, node) processes join.

    Stable: the staying ranks keep their relative order and come first; joiners follow in the order
    given. Returns (holders, members, moved) where ``moved`` maps each staying old rank to its new one."""
    staying = [r for r in sorted(holders) if r not in leaving]
    moved = {old: new for new, old in enumerate(staying)}
    new_holders = {moved[r]: holders[r] for r in staying}
    new_members = {moved[r]: members[r] for r in staying}
    for holder, node in joining:
        rank = len(new_holders)
        new_holders[rank], new_members[rank] = holder, node
    return new_holders, new_members, moved

"""Which device of its node each process of an agent uses (its ``LOCAL_RANK``), spares included.

A node runs ``nproc_per_node`` workers and ``spares`` hot spares; with one accelerator each (nccl:
``cuda:LOCAL_RANK``), a spare needs a device of its own *before* it is promoted, so that it can create
its context and build its model while it waits, and a process that replaces another takes the device
the other one freed. Slots are handed out lowest first: workers take 0..n-1 in local-rank order, the
spares n..n+s-1; a slot is free again once the process holding it is gone for good (not when it is
restarted in place: the restarted process keeps it). More processes than slots get new ones (on CPU
nothing is bound to a slot; on a GPU node that is one process too many, which the transport's device
check reports).

With ``HP_PIN_CORES=1`` each rank also pins itself to one CPU core (:func:`pin_to_core`): so that no rank
gains from another's idle time when several share a small host (benchmarks, the fair runs of the chaos harness).
"""

from __future__ import annotations

import os

PIN_ENV = "HP_PIN_CORES"  # "1": a rank pins itself to core (rank mod usable cores)
_USABLE = sorted(os.sched_getaffinity(0))  # before any pin: a renumbered rank re-pins within these


def pin_to_core(rank: int, env: dict[str, str] | None = None) -> int | None:
    """Pin this process to one core, ``rank`` modulo the cores it may use, when ``HP_PIN_CORES=1``.

    Returns the core, or None when pinning is off. Torch's intra-op pool follows the process's
    affinity only for threads started later, so call it before the first torch op (or set
    ``OMP_NUM_THREADS=1``, as every multi-rank launcher here does)."""
    if (env if env is not None else os.environ).get(PIN_ENV) != "1":
        return None
    core = _USABLE[rank % len(_USABLE)]
    os.sched_setaffinity(0, {core})
    return core


class DeviceSlots:
    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"a node has a non-negative number of device slots, got {count}")
        self.count = count
        self._free = set(range(count))

    def take(self) -> int:
        """The lowest free slot (a new one when every slot is held)."""
        if not self._free:
            self.count += 1
            return self.count - 1
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def release(self, slot: int) -> None:
        """The process holding ``slot`` is gone for good (idempotent)."""
        if 0 <= slot < self.count:
            self._free.add(slot)

    @property
    def free(self) -> list[int]:
        return sorted(self._free)

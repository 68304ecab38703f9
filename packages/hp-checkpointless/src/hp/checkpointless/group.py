"""The process group of this rank's current generation: form it, run collectives on it, release it.

The lessons that shaped it (DESIGN.md, "Releasing a failed gloo group"): a failed collective's error
is raised *outside* the ``except`` block, so the torch frames that hold the group are gone and
destroying the group really closes its sockets (a peer blocked in one of its collectives is then
released); every tensor handed to a collective stays referenced from Python by its owner, so gloo's
worker threads never need the GIL while the teardown waits for them; and whatever else holds the
group (a ZeroRedundancyOptimizer) lets go of it first (``on_release``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hp.checkpointless.events import EventLog
from hp.checkpointless.recovery import CollectiveError, RecoveryMachine
from hp.core.protocol import Event


class GroupLink:
    def __init__(self, transport: Any, store: dist.Store, machine: RecoveryMachine, pg_timeout: timedelta,
                 events: EventLog, on_release: Callable[[], None]) -> None:
        self._transport, self._store, self._machine = transport, store, machine
        self._pg_timeout, self._events = pg_timeout, events
        self._on_release = on_release  # under the lock, before the teardown: whatever else holds the group lets go
        self._lock = threading.Lock()
        self.live = False
        self.rank, self.world_size = -1, 0

    def form(self, rank: int, world_size: int, generation: int) -> None:
        """Initialise the group of ``generation`` (the machine is already FORMING it)."""
        with self._lock:
            self._transport.init_process_group(self._store, rank, world_size, generation, self._pg_timeout)
            self.live = True
        self.rank, self.world_size = rank, world_size

    def collective(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` (a collective, or a transfer made of several) on this generation's group;
        any failure comes out as :class:`CollectiveError`."""
        why = self._machine.superseded()
        if why is not None:
            raise CollectiveError(why)
        try:
            fn(*args)
            return
        except (RuntimeError, ValueError) as e:  # gloo errors, state transfer errors, a destroyed group
            error = f"{getattr(fn, '__name__', 'transfer')} failed in generation {self._machine.generation}: {e}"
        raise CollectiveError(error)  # outside the except block: see the module docstring

    def release(self) -> None:
        """Tear the failed group down through the transport (for gloo: destroy, which closes the sockets
        that peers still blocked in one of its collectives wait on); no-op when there is none."""
        with self._lock:
            if not self.live:
                return
            self.live = False
            self._on_release()
            self._transport.abort()
            self._events.record(Event.RELEASED, generation=self._machine.generation, rank=self.rank)

    def close(self) -> None:
        with self._lock:
            if self.live and dist.is_initialized():
                self.live = False
                dist.destroy_process_group()

"""The process group of this rank's current generation: form it, run collectives on it, release it.

The lessons that shaped it (DESIGN.md, "Releasing a failed gloo group"): a failed collective's error
is raised *outside* the ``except`` block, so the torch frames that hold the group are gone and
destroying the group really closes its sockets (a peer blocked in one of its collectives is then
released); every tensor handed to a collective stays referenced from Python by its owner, so gloo's
worker threads never need the GIL while the teardown waits for them; and whatever else holds the
group (a ZeroRedundancyOptimizer) lets go of it first (``on_release``). Forming reads the rendezvous
keys through :class:`FormingStore`, so a peer that died after the arrival barrier costs a re-form, not
the group's whole init timeout, and bounds gloo's connects by :data:`CONNECT_TIMEOUT`. A job that
shards its model on a device mesh (:mod:`hp.checkpointless.mesh`) gets the mesh's groups formed with
the default group and unbound first when it is released.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hp.checkpointless.events import EventLog
from hp.checkpointless.recovery import CollectiveError, RecoveryMachine
from hp.core.protocol import Event


# How long forming waits for a peer that published its address and died before it connected: a wait
# inside gloo's C++ that nothing can abandon (without a bound of its own it lasts five times the group's
# timeout, 300 s with the default 60 s). A live peer connects within milliseconds of publishing.
CONNECT_TIMEOUT = timedelta(seconds=10)


class FormingStore(dist.Store):
    """The store a group's init reads its peers' rendezvous keys from: it gives up (``CollectiveError``)
    as soon as ``abandoned()`` says why (the watch thread saw a newer generation), where the backend
    would wait out its whole timeout for a peer that died after arriving. Waits block on the store in
    slices of ``slice_s`` (one request per slice per rank while forming; nothing polls in between), up to
    ``timeout`` however short a timeout the backend passes (gloo passes the short init timeout that
    bounds its connects: see :data:`CONNECT_TIMEOUT`)."""

    def __init__(self, store: dist.Store, abandoned: Callable[[], str | None], timeout: timedelta,
                 slice_s: float = 0.2) -> None:
        super().__init__()
        self._store, self._abandoned = store, abandoned
        self._timeout_s, self._slice = timeout.total_seconds(), timedelta(seconds=slice_s)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else max(timeout.total_seconds(), self._timeout_s)
        deadline = time.monotonic() + limit
        while True:
            why = self._abandoned()
            if why is not None:
                raise CollectiveError(f"forming the group abandoned: {why}")
            try:
                self._store.wait(keys, min(self._slice, timedelta(seconds=max(deadline - time.monotonic(), 0.001))))
                return
            except dist.DistStoreError:
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"wait timeout after {limit:.0f} s, keys: {keys}") from None

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._store.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = max(timeout.total_seconds(), self._timeout_s)


class GroupLink:
    def __init__(self, transport: Any, store: dist.Store, machine: RecoveryMachine, pg_timeout: timedelta,
                 events: EventLog, on_release: Callable[[], None]) -> None:
        self._transport, self._store, self._machine = transport, store, machine
        self._pg_timeout, self._events = pg_timeout, events
        self._on_release = on_release  # under the lock, before the teardown: whatever else holds the group lets go
        self._lock = threading.Lock()
        self.live = False
        self.rank, self.world_size = -1, 0
        self._forming_store: FormingStore | None = None
        self._hosted: dict[str, dist.Store] = {}  # clients of agent-hosted forming stores, by HOST:PORT
        self.mesh: Any = None  # a GenerationMesh (hp.checkpointless.mesh), formed with every generation

    def form(self, rank: int, world_size: int, generation: int, forming_store: str = "") -> None:
        """Initialise the group of ``generation`` (the machine is already FORMING it) on the store its plan
        names (``forming_store``, a node agent's ``TCPStore``), else on the job's store."""
        base = self._hosted_store(forming_store) if forming_store else self._store
        store = FormingStore(base, self._machine.superseded, self._pg_timeout)
        with self._lock:
            connect_timeout = min(CONNECT_TIMEOUT, self._pg_timeout)
            self._transport.init_process_group(store, rank, world_size, generation, self._pg_timeout,
                                               connect_timeout=connect_timeout)
            self.live = True
            if self.mesh is not None:
                self.mesh.form(self._transport, rank, world_size, self._pg_timeout, connect_timeout)
        self._forming_store = store  # the group holds it: kept referenced from Python while the group lives
        self.rank, self.world_size = rank, world_size

    def _hosted_store(self, address: str) -> dist.Store:
        """A client of the agent-hosted store at ``address``, connected in short tries so that a
        generation superseded meanwhile (its host died) is given up at once."""
        if address not in self._hosted:
            host, _, port = address.rpartition(":")
            deadline = time.monotonic() + self._pg_timeout.total_seconds()
            while True:
                try:
                    client = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=2))
                    break
                except (RuntimeError, ValueError) as e:  # DistNetworkError, refused, timed out
                    why = self._machine.superseded()
                    if why is not None or time.monotonic() > deadline:
                        raise CollectiveError(why or f"forming store {address} unreachable: {e}") from None
            client.set_timeout(self._pg_timeout)
            self._hosted[address] = client
        return self._hosted[address]

    def collective(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (a collective, or a transfer made of several) on this generation's
        group; its result (an async collective's work); any failure comes out as :class:`CollectiveError`."""
        why = self._machine.superseded()
        if why is not None:
            raise CollectiveError(why)
        try:
            return fn(*args, **kwargs)
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
            if self.mesh is not None:
                self.mesh.release()
            self._on_release()
            self._transport.abort()
            self._events.record(Event.RELEASED, generation=self._machine.generation, rank=self.rank)

    def close(self) -> None:
        with self._lock:
            if self.live and dist.is_initialized():
                self.live = False
                if self.mesh is not None:
                    self.mesh.release()
                dist.destroy_process_group()

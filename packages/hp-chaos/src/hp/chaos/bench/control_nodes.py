"""The simulated nodes of ``hp bench control`` (:mod:`hp.chaos.bench.control`): one process holds a share of
them, their ranks as threads, and answers the harness over a pipe.

A rank of ``per_rank_poll`` is a thread with its own store client that does what a worker's watch thread
did before the relay: every 10 ms ``check`` + ``get`` of the generation key (as ``JobView.value``), and
on a new generation a ``check`` + ``get`` of its plan. A node of ``per_node_fanout`` is a
:class:`~hp.core.fanout.Relay` (its own store client) and its ranks :class:`~hp.core.fanout.Mirror` s of
the relay's channel. A rank has a generation once one of its threads holds that plan's bytes (the poll
thread's ``get`` returned; the mirror's reader applied it): verifying the plan is each rank's own work,
on its own core in a job, and is timed apart (``plan_verify_s``). Every store client counts the requests
it sends (:func:`counting`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hp.core.protocol import GENERATION_KEY, plan_key

POLL_S = 0.01  # the watch thread's period before the relay
TOKEN = "b" * 64  # the harness's job token


@dataclass(frozen=True)
class GroupSpec:
    """What one process of simulated nodes runs: ``nodes`` nodes from ``first_node`` on, their ranks,
    against the store (``store`` backend at ``host:port``, ``job``'s keys on etcd)."""

    mode: str
    first_node: int
    nodes: int
    ranks_per_node: int
    ranks: int  # of this group (its last node may have fewer than ranks_per_node)
    relay_wait_s: float
    store: str
    host: str
    port: int
    job: str | None
    timeout_s: float


@functools.cache
def _counting_type() -> type:
    import torch.distributed as dist

    class CountingStore(dist.Store):
        """A store client that counts the requests it sends (one thread uses it, like any client)."""

        def __init__(self, store: dist.Store) -> None:
            super().__init__()
            self._store, self.requests = store, 0

        def set(self, key, value):
            self.requests += 1
            return self._store.set(key, value)

        def get(self, key):
            self.requests += 1
            return self._store.get(key)

        def add(self, key, amount):
            self.requests += 1
            return self._store.add(key, amount)

        def check(self, keys):
            self.requests += 1
            return self._store.check(keys)

        def compare_set(self, key, expected, desired):
            self.requests += 1
            return self._store.compare_set(key, expected, desired)

        def wait(self, keys, timeout=None):
            self.requests += 1
            return self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)

        def set_timeout(self, timeout):  # the client's own setting: no request
            self._store.set_timeout(timeout)

    return CountingStore


def counting(store: Any) -> Any:
    """``store`` behind a ``dist.Store`` that counts its requests in ``.requests``."""
    return _counting_type()(store)


class Group:
    """The ranks (and, fan-out, the relays) of one process's share of the simulated nodes."""

    def __init__(self, spec: GroupSpec) -> None:
        from hp.core.plugins import get_backend

        self.spec = spec
        backend, timeout = get_backend("store", spec.store), timedelta(seconds=spec.timeout_s)
        extra = {"job": spec.job} if spec.job else {}
        self._connect = functools.partial(backend.connect, spec.host, spec.port, timeout, **extra)
        self._clients: list[Any] = []
        self._stop = threading.Event()
        self._times: dict[int, dict[int, float]] = {}  # generation -> {rank: when that rank had its plan}
        self._seen = [0] * spec.ranks  # the newest generation each rank had
        self._cond = threading.Condition()
        self._relays: list[Any] = []
        self._mirrors: list[Any] = []

    def _client(self) -> Any:
        self._clients.append(counting(self._connect()))
        return self._clients[-1]

    def _had(self, rank: int, generation: int) -> None:
        self._seen[rank] = generation
        with self._cond:
            got = self._times.setdefault(generation, {})
            got.setdefault(rank, time.monotonic())
            if len(got) == self.spec.ranks:
                self._cond.notify_all()

    def _poll(self, rank: int, store: Any) -> None:
        from hp.core.signed_values import unseal

        last = None
        while not self._stop.wait(POLL_S):
            if not store.check([GENERATION_KEY]):
                continue
            raw = store.get(GENERATION_KEY)
            if raw == last:
                continue
            last, g = raw, int(unseal(TOKEN, GENERATION_KEY, raw))
            if g > self._seen[rank] and store.check([plan_key(g)]):
                store.get(plan_key(g))
                self._had(rank, g)

    def _mirrored(self, rank: int, mirror: Any) -> None:  # the mirror's reader thread
        while mirror.get(plan_key(self._seen[rank] + 1)) is not None:
            self._had(rank, self._seen[rank] + 1)

    def start(self) -> None:
        """Start every rank; return once each has generation 1 (the harness published it)."""
        from hp.core.fanout import Mirror, Relay

        per = self.spec.ranks_per_node
        if self.spec.mode == "per_rank_poll":
            for rank in range(self.spec.ranks):  # clients made here, one after the other: many threads
                client = self._client()  # connecting at once time out
                threading.Thread(target=self._poll, args=(rank, client), daemon=True).start()
        else:
            for node in range(self.spec.nodes):
                client = self._client()
                self._relays.append(Relay(lambda c=client: c, TOKEN, self.spec.first_node + node,
                                          wait_s=self.spec.relay_wait_s, log=lambda m: None).start())
            for rank in range(self.spec.ranks):
                self._mirrors.append(Mirror(self._relays[rank // per].channel.path,
                                            on_change=functools.partial(self._mirrored, rank)))
        if len(self.arrivals(1)) < self.spec.ranks:
            raise TimeoutError(f"not every rank had generation 1 within {self.spec.timeout_s:g} s")

    def requests(self) -> int:
        return sum(c.requests for c in self._clients)

    def arrivals(self, generation: int) -> list[tuple[int, float]]:
        """(node, when) a rank had ``generation``, for each rank that did within the timeout."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._times.get(generation, ())) == self.spec.ranks,
                                self.spec.timeout_s)
            return [(self.spec.first_node + rank // self.spec.ranks_per_node, t)
                    for rank, t in self._times.get(generation, {}).items()]

    def stop(self) -> None:
        self._stop.set()
        for relay in self._relays:
            relay.stop()
        for mirror in self._mirrors:
            mirror.close()


def serve(conn: Any, spec: GroupSpec) -> None:
    """A process of simulated nodes (the harness starts it): build them, then answer ``("requests", _)``,
    ``("arrivals", generation)`` and ``("stop", _)`` over ``conn``. It leaves with ``os._exit``: relays
    may still be blocked in a store read, and the interpreter's shutdown would wait on them."""
    try:
        group = Group(spec)
        group.start()
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 -- told to the harness, then this process ends
        conn.send(("error", f"{type(e).__name__}: {str(e)[:300]}"))
        os._exit(1)
    while True:
        command, arg = conn.recv()
        if command == "requests":
            conn.send(group.requests())
        elif command == "arrivals":
            conn.send(group.arrivals(arg))
        else:
            group.stop()
            conn.send(None)
            os._exit(0)

"""Per-node services: what ``hp run --service NAME[:KEY=VALUE,...]`` starts beside this node's workers.

Some things must live on every node, next to the workers, and outlive any one of them: the
checkpoint daemon of ``hp-tiered-ckpt`` holds the memory tier, so that a worker that crashes loses
nothing. hp-core knows no such service by name; packages contribute them through the
``node_service`` plugin family (:func:`hp.core.hookspecs.hp_node_services`), and the agent drives
their lifecycle through :class:`ServiceHost`:

1. ``start(node)`` after the rendezvous and before any worker: the service binds ``node.address``
   (the interface the other nodes reach this one on, never a wildcard) and returns a
   :class:`RunningService` whose ``endpoint`` the other nodes need.
2. Every node publishes each endpoint in the job's store and waits for all the others', so each
   service learns its counterparts (``connect``), indexed by node rank: a ring of replicas needs it.
3. ``worker_env()`` goes into the environment of every worker and spare the agent starts.
4. ``poll()`` each heartbeat: a dead service is reported once and the job goes on (a checkpoint
   that cannot be taken is a warning in the workers, not a failure of the job).
5. ``stop()`` after the workers have stopped, whatever ended the job.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

from hp.core.backends.api import NodeContext, NodeService, RunningService, ServiceError  # noqa: F401
from hp.core.errors import UsageError
from hp.core.protocol import ProtocolError, node_service_key
from hp.core.signed_values import Refusals, seal, unseal

if TYPE_CHECKING:
    import torch.distributed as dist


def parse_service_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (as given to ``--service``) -> (name, options)."""
    name, _, rest = spec.partition(":")
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise UsageError(f"--service: expected NAME[:KEY=VALUE,...], got {spec!r}")
    options: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--service {name}: expected KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    return name, options


class ServiceHost:
    """The node services of one agent, started and stopped together."""

    def __init__(self, specs: list[str]) -> None:
        from hp.core.plugins import get_backend

        parsed = [parse_service_spec(s) for s in specs]
        names = [name for name, _ in parsed]
        if len(set(names)) != len(names):
            raise UsageError(f"--service: a service is named twice in {names}")
        self._specs = [(get_backend("node_service", name), options) for name, options in parsed]
        self._running: list[tuple[str, RunningService]] = []
        self._reported: set[str] = set()
        self._env: dict[str, str] = {}

    def start(self, node: NodeContext, store: dist.Store | None, timeout_s: float,
              keep_alive: Callable[[], None] = lambda: None) -> None:
        """Start every service, then exchange endpoints with the other nodes through ``store``.
        ``keep_alive`` is called while waiting (the agent heartbeats, and learns if the job failed)."""
        for backend, options in self._specs:
            running = backend.start(replace(node, options=options))
            self._running.append((backend.name, running))
        for name, running in self._running:
            endpoints = [running.endpoint] if node.nnodes == 1 else \
                self._exchange(store, name, node, running.endpoint, timeout_s, keep_alive)
            running.connect(endpoints)
            self._env.update(running.worker_env())

    @staticmethod
    def _exchange(store: dist.Store, name: str, node: NodeContext, endpoint: str, timeout_s: float,
                  keep_alive: Callable[[], None]) -> list[str]:
        keys = [node_service_key(name, n) for n in range(node.nnodes)]
        mine = seal(node.token, keys[node.node_rank], endpoint)  # sealed: a forged endpoint is refused
        store.set(keys[node.node_rank], mine)
        refusals = Refusals()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                store.wait(keys, timedelta(seconds=1))
                got = [_endpoint(store, node.token, k, refusals) for k in keys]
                if all(e is not None for e in got):
                    return got  # type: ignore[return-value]
                missing = [n for n, e in enumerate(got) if e is None]
                if got[node.node_rank] is None:  # a forger overwrote this node's own endpoint
                    store.set(keys[node.node_rank], mine)
                time.sleep(0.2)  # a forged value is there to stay: wait for its owner to publish again
            except RuntimeError:  # torch's store timeout (DistStoreError is a RuntimeError)
                missing = [n for n, k in enumerate(keys) if not store.check([k])]
            if time.monotonic() > deadline:
                raise ServiceError(f"node service {name}: nodes {missing} did not publish their "
                                   f"endpoints within {timeout_s:.0f} s") from None
            keep_alive()

    def worker_env(self) -> dict[str, str]:
        return dict(self._env)

    def check(self) -> list[str]:
        """One line for each service that has ended since the last check."""
        lines = []
        for name, running in self._running:
            ended = running.poll()
            if ended is not None and name not in self._reported:
                self._reported.add(name)
                lines.append(f"node service {name} ended: {ended}; its workers go on without it")
        return lines

    def stop(self) -> None:
        while self._running:
            _, running = self._running.pop()
            running.stop()


def _endpoint(store: dist.Store, token: str, key: str, refusals: Refusals) -> str | None:
    """The endpoint a node published at ``key``; None (refused, reported) if it is not sealed for it."""
    try:
        return unseal(token, key, store.get(key))
    except ProtocolError as e:
        refusals.report(key, e)
        return None

"""Coordination store backends: the job's key-value rendezvous for process groups.

The default is torch's ``TCPStore`` hosted by the controller; ``etcd`` keeps the keys in an etcd
cluster that no rank hosts (:mod:`hp.core.etcd_store`). Nothing outside this family knows which
store is in use.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from hp.core.backends.api import StoreBackend, StoreServer
from hp.core.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch.distributed as dist

CONNECT_RETRY_S = 0.05  # between refused connects to a TCPStore not (or no longer) listening


class TCPStoreBackend(StoreBackend):
    """torch ``TCPStore``. The listening socket is bound here, to the interface asked for:
    ``TCPStore`` itself would listen on every interface."""

    name = "tcp"

    def serve(self, host: str, port: int = 0) -> StoreServer:
        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        bound_port = sock.getsockname()[1]
        store = dist.TCPStore(
            host, bound_port, is_master=True, wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
        return StoreServer(host, bound_port, store, [sock])

    def connect(self, host: str, port: int, timeout: timedelta = timedelta(seconds=60),
                job: str | None = None) -> dist.Store:
        """A refused connect is retried here, in Python, until ``timeout``: torch's own loop (2.3 to 5 s
        for a 2 s timeout, C++ with the GIL released) must not hold a daemon thread when its process
        exits: the thread's return into the finalizing interpreter aborts the process (SIGABRT)."""
        import torch.distributed as dist

        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic())).close()
                break
            except OSError as e:
                if time.monotonic() + CONNECT_RETRY_S >= deadline:
                    raise dist.DistNetworkError(f"store at {host}:{port} unreachable for "
                                                f"{timeout.total_seconds():g} s: {e}") from None
                time.sleep(CONNECT_RETRY_S)
        left = timedelta(seconds=max(deadline - time.monotonic(), CONNECT_RETRY_S))
        client = dist.TCPStore(host, port, is_master=False, timeout=left)  # one job's: its host's
        client.set_timeout(timeout)
        return client


class EtcdStoreBackend(StoreBackend):
    """Keys in etcd (:mod:`hp.core.etcd_store`): no rank or agent hosts them, so they outlive any one
    host of the job. ``connect`` reaches an existing cluster (``host`` may list several members,
    ``h1:2379,h2:2379``) under one job's prefix (``job``, else ``$HP_STORE_JOB``, else ``default``);
    ``serve`` starts a private single-member etcd on ``host`` (tests, single-node jobs)."""

    name = "etcd"

    def serve(self, host: str, port: int = 0, job: str | None = None) -> StoreServer:
        from hp.core.etcd_store import EtcdServer, connect

        server = EtcdServer(host, port).start()
        try:
            store = connect(server.endpoint, server.port, job=job)
        except BaseException:
            server.stop()
            raise
        return StoreServer(host, server.port, store, [server])

    def connect(self, host: str, port: int, timeout: timedelta = timedelta(seconds=60),
                job: str | None = None) -> dist.Store:
        from hp.core.etcd_store import connect

        return connect(host, port, timeout, job=job)


@hookimpl
def hp_store_backends() -> list[StoreBackend]:
    return [TCPStoreBackend(), EtcdStoreBackend()]

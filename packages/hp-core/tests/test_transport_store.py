"""Transport and store plugins: EFA defaults, generation-scoped stores, interface binding."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hp.core import generation_prefix, get_backend
from hp.testing import listening_addresses
from hp.core.transport import EFA_ENV_DEFAULTS, NcclTransport


def fake_sysfs(root: Path, devices: dict[str, str]) -> str:
    for dev, driver in devices.items():
        (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (root / dev / "device").mkdir(parents=True)
        os.symlink(root / "drivers" / driver, root / dev / "device" / "driver")
    return str(root)


def test_nccl_sets_efa_defaults_only_where_efa_exists(tmp_path):
    assert NcclTransport(sysfs=fake_sysfs(tmp_path / "a", {"mlx5_0": "mlx5_core"})).env_defaults() == {}
    env = NcclTransport(sysfs=fake_sysfs(tmp_path / "b", {"rdmap16s27": "efa"})).env_defaults()
    assert env == EFA_ENV_DEFAULTS and env["FI_PROVIDER"] == "efa"


def test_gloo_runs_on_cpu_and_nccl_names_its_device():
    assert get_backend("transport", "gloo").device_for(3) == "cpu"
    assert get_backend("transport", "nccl").device_for(3) == "cuda:3"


def test_tcp_store_listens_only_on_the_interface_asked_for():
    backend = get_backend("store", "tcp")
    server = backend.serve("127.0.0.1")
    try:
        assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or ::
        client = backend.connect("127.0.0.1", server.port, timedelta(seconds=5))
        client.set("k", "v")
        assert server.store.get("k") == b"v"
    finally:
        server.close()


def test_a_refused_tcp_store_connect_is_retried_in_python_never_in_torchs_loop(monkeypatch, free_port):
    """Nobody listens: the connect gives up after its timeout, in one line, without entering torch's
    C++ connect loop (2.3 to 5 s for a 2 s timeout, GIL released): a daemon thread returning from it into
    an exiting interpreter aborted a fenced agent (SIGABRT instead of exit 1)."""
    import torch.distributed as dist
    from hp.core import store

    def no_torch(*a, **k):
        raise AssertionError("entered torch's connect with nobody listening")

    monkeypatch.setattr(dist, "TCPStore", no_torch)
    t0 = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match=f"store at 127.0.0.1:{free_port} unreachable for 0.3 s") as e:
        store.TCPStoreBackend().connect("127.0.0.1", free_port, timedelta(seconds=0.3))
    assert 0.25 <= time.monotonic() - t0 < 5 and "\n" not in str(e.value)


def test_a_tcp_store_connect_waits_for_a_server_that_starts_late(free_port):
    """As torch's own connect does: a server listening within the timeout is reached."""
    backend = get_backend("store", "tcp")
    servers = []
    timer = threading.Timer(0.5, lambda: servers.append(backend.serve("127.0.0.1", free_port)))
    timer.start()
    try:
        client = backend.connect("127.0.0.1", free_port, timedelta(seconds=10))
        client.set("k", "v")
        timer.join()
        assert servers[0].store.get("k") == b"v"
    finally:
        timer.join()
        for s in servers:
            s.close()


def test_generations_never_share_rendezvous_keys():
    import torch.distributed as dist

    backend = get_backend("store", "tcp")
    server = backend.serve("127.0.0.1")
    try:
        g1 = dist.PrefixStore(generation_prefix(1), server.store)
        g2 = dist.PrefixStore(generation_prefix(2), server.store)
        g1.set("rank0_addr", "old")
        g2.set("rank0_addr", "new")
        assert g1.get("rank0_addr") == b"old" and g2.get("rank0_addr") == b"new"
        g1.set("only_in_g1", "x")
        with pytest.raises(dist.DistStoreError):
            g2.wait(["only_in_g1"], timedelta(milliseconds=200))
    finally:
        server.close()

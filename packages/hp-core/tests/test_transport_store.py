"""Transport and store plugins: EFA defaults, generation-scoped stores, interface binding."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

from hp.core import generation_prefix, get_backend
from hp.core.transport import EFA_ENV_DEFAULTS, NcclTransport
from hp.core.testing import listening_addresses


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

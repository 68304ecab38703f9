"""The local scheduler backend: host list, capacity, and TorchX submission on ``local_cwd``."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from torchx import specs

from hp.core import get_backend
from hp.core.schedulers.api import Capacity
from hp.core.schedulers.local import LocalScheduler
from hp.testing import kill_tagged, wait_for

TX_MARKER = Path(__file__).parent / "workers" / "tx_marker.py"


@pytest.fixture
def scheduler(tmp_path: Path):
    backend = get_backend("scheduler", "local")
    yield backend
    backend.close()  # stops whatever its TorchX runner still runs
    kill_tagged(f"HP_TEST_DIR={tmp_path}")


def _marker_app(tmp_path: Path, **env: str) -> specs.AppDef:
    return specs.AppDef(
        name="tx-marker",
        roles=[
            specs.Role(
                name="marker",
                image=str(tmp_path),
                entrypoint=sys.executable,
                args=[str(TX_MARKER)],
                env={"HP_TEST_DIR": str(tmp_path), **env},
            )
        ],
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_local_backend_is_registered():
    backend = get_backend("scheduler", "local")
    assert isinstance(backend, LocalScheduler)
    assert backend.torchx_scheduler == "local_cwd"


def test_hosts_and_capacity(scheduler):
    assert scheduler.hosts() == [socket.gethostname()]
    cap = scheduler.capacity()
    assert isinstance(cap, Capacity)
    assert cap.hosts == 1
    assert cap.slots_per_host >= 1
    assert cap.preemption_requested is False


@pytest.mark.timeout(60)
def test_submit_and_wait_succeeds(scheduler, tmp_path):
    handle = scheduler.submit(_marker_app(tmp_path), cfg={"log_dir": str(tmp_path / "torchx")})
    assert handle.startswith("local_cwd://")
    status = scheduler.wait(handle, poll_s=0.1)
    assert status is not None and status.is_terminal()
    assert status.state == specs.AppState.SUCCEEDED, status
    assert (tmp_path / "tx_rank0.done").exists()


@pytest.mark.timeout(60)
def test_submit_reports_failure(scheduler, tmp_path):
    handle = scheduler.submit(_marker_app(tmp_path, TX_EXIT_CODE="3"), cfg={"log_dir": str(tmp_path / "torchx")})
    status = scheduler.wait(handle, poll_s=0.1)
    assert status is not None and status.state == specs.AppState.FAILED, status
    assert (tmp_path / "tx_rank0.done").exists()


@pytest.mark.timeout(60)
def test_cancel_stops_the_app(scheduler, tmp_path):
    handle = scheduler.submit(_marker_app(tmp_path, TX_SLEEP_S="120"), cfg={"log_dir": str(tmp_path / "torchx")})
    pid_file = tmp_path / "tx_rank0.pid"
    wait_for(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), timeout=30, what="the worker to start")
    pid = int(pid_file.read_text())
    assert _alive(pid)
    scheduler.cancel(handle)
    status = scheduler.wait(handle, poll_s=0.1)
    assert status is not None and status.is_terminal(), status
    assert status.state != specs.AppState.SUCCEEDED, status
    assert status.state == specs.AppState.CANCELLED, status
    wait_for(lambda: not _alive(pid), timeout=15, what=f"worker pid {pid} to exit")
    assert not (tmp_path / "tx_rank0.done").exists()


def test_close_releases_the_runner(tmp_path):
    backend = LocalScheduler()
    try:
        handle = backend.submit(_marker_app(tmp_path, TX_SLEEP_S="120"), cfg={"log_dir": str(tmp_path / "torchx")})
        pid_file = tmp_path / "tx_rank0.pid"
        wait_for(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), timeout=30, what="the worker to start")
        pid = int(pid_file.read_text())
        assert handle and _alive(pid)
        backend.close()
        assert backend._runner is None
        wait_for(lambda: not _alive(pid), timeout=15, what=f"worker pid {pid} to exit on close")
    finally:
        backend.close()
        kill_tagged(f"HP_TEST_DIR={tmp_path}")


@pytest.mark.parametrize("text, replicas", [("3\n", 3), ("three", None), ("9" * 40, None), ("", None), (None, None)])
def test_the_capacity_file_gives_a_number_of_ranks_or_nothing(scheduler, tmp_path, text, replicas):
    path = tmp_path / "capacity"
    if text is not None:
        path.write_text(text)
    assert scheduler.capacity(str(path)).replicas == replicas  # a bad or missing file never crashes the agent

"""The storage fault against real server processes: a client sees the endpoint go away for the
outage and come back after it, in both modes (SIGSTOP of the server; iptables REJECT of its port)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from hp.chaos.faults.storage import StorageOutage, StorageServer
from hp.testing import free_port, wait_for


def answers(url: str) -> bool | str:
    """True if the server answered (any HTTP status), else why not: 'timeout' or 'refused'."""
    try:
        urllib.request.urlopen(url, timeout=1.0)
    except urllib.error.HTTPError:
        return True
    except (TimeoutError, socket.timeout):
        return "timeout"
    except urllib.error.URLError as e:
        return "timeout" if isinstance(e.reason, (TimeoutError, socket.timeout)) else "refused"
    except (ConnectionResetError, ConnectionRefusedError):
        return "refused"
    return True


@pytest.fixture
def http_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: answers(url) is True, timeout=60, what="http.server")
        yield StorageServer(proc.pid, port), url
    finally:
        proc.kill()
        proc.wait()


def test_stop_mode_freezes_the_server_for_the_outage_only(http_server):
    server, url = http_server
    with StorageOutage(server, "stop") as outage:
        assert outage.active
        assert answers(url) == "timeout"  # accepted by the kernel, never answered: a hung endpoint
    assert not outage.active
    assert answers(url) is True
    outage.end()  # idempotent


@pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables not installed (scripts/setup.sh installs it)")
def test_block_mode_rejects_the_port_and_removes_exactly_its_rule(http_server):
    server, url = http_server
    outage = StorageOutage(server, "block")
    try:
        outage.start()
        assert answers(url) == "refused"  # TCP reset: a dead endpoint
        rules = subprocess.run(["iptables", "-w", "-S", "INPUT"], capture_output=True, text=True).stdout
        assert outage._comment in rules
    finally:
        outage.end()
    assert answers(url) is True
    rules = subprocess.run(["iptables", "-w", "-S", "INPUT"], capture_output=True, text=True).stdout
    assert outage._comment not in rules


def test_seaweedfs_s3_endpoint_goes_away_and_comes_back():
    seaweed = pytest.importorskip("hp.tiered_ckpt.seaweed", reason="SeaweedFS helper comes with hp-tiered-ckpt")
    try:
        s3 = seaweed.SeaweedS3().start()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        url = f"{s3.endpoint}/{s3.bucket}"
        assert answers(url) is True  # 403 to an unsigned request: up and checking signatures
        start = time.monotonic()
        with StorageOutage(StorageServer(s3.proc.pid, s3.ports["s3.port"]), "stop"):
            assert answers(url) == "timeout"
        assert time.monotonic() - start < 30
        wait_for(lambda: answers(url) is True, timeout=30, what="S3 endpoint back")
    finally:
        s3.stop()


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        StorageOutage(StorageServer(1, 1), "unplug")

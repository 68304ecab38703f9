"""The ``etcd`` store backend against a real etcd (the Debian etcd-server binary) and CPU gloo groups on
it.

Each xdist worker starts its own etcd (free client and peer ports, data in a tmp dir) once per module;
it is killed and its directory removed whatever the tests do."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hp.core import get_backend
from hp.core.errors import UsageError
from hp.testing import HP, listening_addresses

from hp.core import etcd_store  # noqa: E402

# scripts/setup.sh installs both: a missing one fails these tests (a skip would pass unseen)
assert etcd_store.etcd is not None, "python-etcd is not installed (pip install 'hp-core[etcd]')"
etcd_store.etcd_binary()  # raises UsageError naming the package when the etcd server is missing

WORKERS = Path(__file__).parent / "workers"
T5 = timedelta(seconds=5)


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    """One real etcd for this module (this xdist worker): stopped and removed even when a test fails."""
    server = etcd_store.EtcdServer("127.0.0.1", workdir=str(tmp_path_factory.mktemp("etcd")),
                                  die_with_parent=True)
    try:
        yield server.start()
    finally:
        server.stop()


def etcd_client(server, job: str | None = None, timeout: timedelta = T5):
    return get_backend("store", "etcd").connect(server.host, server.port, timeout, job=job or uuid.uuid4().hex)


def store_ops(s: dist.Store) -> list:
    """A script of Store API calls; every value it returns, in order."""
    out = []
    s.set("a", "1")
    out.append(s.get("a"))
    out += [s.add("n", 3), s.add("n", 0), s.add("n", -1), s.add("fresh", 0)]
    out += [s.check(["a", "n"]), s.check(["a", "missing"])]
    s.wait(["a", "n"])
    s.wait(["a"], timedelta(seconds=1))
    out += [s.compare_set("c", "", "x"), s.compare_set("c", "y", "z"), s.compare_set("c", "x", "z"), s.get("c")]
    out += [s.compare_set("absent", "e", "f"), s.check(["absent"])]
    s.append("ap", "x")
    s.append("ap", b"y")
    out.append(s.get("ap"))
    s.multi_set(["m1", "m2"], ["v1", b"\x00\xff"])
    out.append(s.multi_get(["m1", "m2", "a"]))
    s.set("odd key ?>~/=+", b"\xff\x00bytes")  # base64 of this holds '/' and '+' in the standard alphabet
    out.append(s.get("odd key ?>~/=+"))
    return out


def test_store_api_through_torch_matches_tcpstore(etcd_server):
    """set/get/add/wait/check/compare_set/append/multi_* through a PrefixStore (torch's C++ calling the
    Python store) give exactly what TCPStore gives; delete_key and num_keys on the store itself."""
    tcp_backend = get_backend("store", "tcp")
    tcp_server = tcp_backend.serve("127.0.0.1")
    try:
        tcp = tcp_backend.connect("127.0.0.1", tcp_server.port, T5)
        etcd = etcd_client(etcd_server)
        assert store_ops(dist.PrefixStore("hp/g1", etcd)) == store_ops(dist.PrefixStore("hp/g1", tcp))
        for s in (tcp, etcd):
            s.set("gone", "1")
        assert [etcd.delete_key("gone"), etcd.delete_key("gone"), etcd.check(["gone"])] == \
               [tcp.delete_key("gone"), tcp.delete_key("gone"), tcp.check(["gone"])] == [True, False, False]
        assert etcd.num_keys() == 8  # the keys store_ops leaves
    finally:
        tcp_server.close()


def test_a_missing_key_times_out_as_torch_does(etcd_server):
    s = etcd_client(etcd_server, timeout=timedelta(seconds=0.3))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError) as e:  # TCPStore's error type (and LookupError, as EtcdStore's)
        dist.PrefixStore("p", s).get("never")
    assert isinstance(e.value, LookupError) and 0.3 <= time.monotonic() - start < 3
    start = time.monotonic()
    with pytest.raises(LookupError):
        s.wait(["never"], timedelta(seconds=0.2))
    assert time.monotonic() - start < 3


def test_a_wait_wakes_on_the_write_not_on_a_poll(etcd_server):
    job = uuid.uuid4().hex
    waiter, writer = etcd_client(etcd_server, job, timedelta(seconds=20)), etcd_client(etcd_server, job)
    timer = threading.Timer(0.3, lambda: writer.set("late", "L"))
    timer.start()
    start = time.monotonic()
    assert waiter.get("late") == b"L"
    assert time.monotonic() - start < 5
    timer.join()


def test_jobs_sharing_one_etcd_never_see_each_others_keys(etcd_server):
    a, b = etcd_client(etcd_server, "job-a"), etcd_client(etcd_server, "job-b")
    a.set("hp/g1/rank0", "a's")
    b.set("hp/g1/rank0", "b's")
    assert (a.get("hp/g1/rank0"), b.get("hp/g1/rank0")) == (b"a's", b"b's")
    assert a.add("count", 2) == 2 and b.add("count", 5) == 5
    assert a.num_keys() == b.num_keys() == 2
    assert a.prefix != b.prefix and a.prefix.startswith("/hp/jobs/job-a/")
    with pytest.raises(UsageError):  # a job name is a path component: no '/', no '..'
        etcd_client(etcd_server, "../job-a")


def test_a_paused_etcd_delays_calls_and_loses_nothing(etcd_server):
    s = etcd_client(etcd_server)
    etcd_server.pause()
    done = threading.Event()
    try:
        t = threading.Thread(target=lambda: (s.set("during", "pause"), done.set()), daemon=True)
        t.start()
        assert not done.wait(0.5)  # etcd is stopped: the write waits
    finally:
        etcd_server.resume()
    assert done.wait(10) and s.get("during") == b"pause"


def test_serve_starts_a_private_etcd_that_close_stops_and_removes():
    backend = get_backend("store", "etcd")
    server = backend.serve("127.0.0.1", job="served")
    etcd = server._keepalive[0]
    try:
        assert stat.S_IMODE(os.stat(etcd.dir).st_mode) == 0o700 and (etcd.dir / "data").is_dir()
        assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1 only
        server.store.set("k", "v")
        assert backend.connect("127.0.0.1", server.port, T5, job="served").get("k") == b"v"
    finally:
        server.close()
    assert etcd.proc.poll() is not None and not etcd.dir.exists() and not listening_addresses(server.port)


def test_endpoints_name_one_or_more_members():
    assert etcd_store.parse_endpoints("e0:2379, e1,[::1]:23790,10.0.0.1", 2379) == \
        [("e0", 2379), ("e1", 2379), ("::1", 23790), ("10.0.0.1", 2379)]
    assert etcd_store.parse_endpoints("::1", 2380) == [("::1", 2380)]


@pytest.mark.timeout(120)
def test_a_gloo_group_forms_on_etcd_and_the_store_outlives_rank_0(etcd_server, tmp_path):
    """4 ranks form a group and all_reduce on the etcd store; rank 0 (the process a TCPStore would live
    in) is SIGKILLed; the other 3 still write and read the store and form generation 2 on it."""
    job, world = uuid.uuid4().hex, 4
    result = tmp_path / "result.json"
    launcher = subprocess.Popen([sys.executable, str(WORKERS / "etcd_group.py"), etcd_server.host,
                                 str(etcd_server.port), job, str(world), str(result)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    store = etcd_client(etcd_server, job, timedelta(seconds=90))
    try:
        store.wait([f"formed/{r}" for r in range(world)])
        rank0 = int(store.get("formed/0"))
        os.kill(rank0, signal.SIGKILL)
        store.set("rank0_killed", "1")
        store.wait([f"reformed/{r}" for r in range(world - 1)])
        assert [store.get(f"reformed/{r}") for r in range(world - 1)] == [str(world - 1).encode()] * (world - 1)
        assert store.add("survivors", 0) == world - 1
        out, _ = launcher.communicate(timeout=60)
        assert json.loads(result.read_text())["exitcodes"] == [-signal.SIGKILL, 0, 0, 0], out[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_hp_backends_lists_the_etcd_store():
    out = subprocess.run([*HP, "backends", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert {"family": "store", "name": "etcd", "dist": "hp-core"} in json.loads(out.stdout)

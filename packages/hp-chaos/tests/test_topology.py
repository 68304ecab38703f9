"""Topology: real network namespaces, veths, a bridge and iptables rules (root only)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hp.chaos import topology
from hp.chaos.topology import Topology, cleanup_stale

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5555)); s.listen()
    print("listening", flush=True)
    while True:
        c, addr = s.accept(); c.sendall(addr[0].encode()); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], 5555), timeout=float(sys.argv[2]))
        print("ok", c.recv(64).decode())
    except OSError as e:
        print(type(e).__name__)
""")


def serve(topo: Topology, i: int) -> subprocess.Popen:
    p = topo.run_in(i, [sys.executable, "-c", SERVER, topo.address(i)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "listening"
    return p


def connect(topo: Topology, src: int, dst: int, timeout: float = 1.0) -> str:
    p = topo.run_in(src, [sys.executable, "-c", CLIENT, topo.address(dst), str(timeout)],
                    stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=30)
    return out.strip()


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_nodes_reach_each_other_by_address_and_instances_do_not_collide():
    with Topology(2) as a, Topology(2) as b:
        assert {a.netns(0), a.netns(1)}.isdisjoint({b.netns(0), b.netns(1)})
        assert a.bridge != b.bridge and a.address(0) != a.address(1)
        assert a.ifname(1) == "eth0"
        serve(a, 1)
        # the server sees node 0's own address: traffic really goes over the veths
        assert connect(a, 0, 1) == f"ok {a.address(0)}"
        with pytest.raises(IndexError, match="outside"):
            a.address(2)


def test_partition_drop_and_reject_then_heal():
    with Topology(3) as topo:
        serve(topo, 1)
        topo.partition(0, 1, mode="drop")
        assert connect(topo, 0, 1, timeout=0.5) == "TimeoutError"
        assert connect(topo, 2, 1).startswith("ok")  # only the pair is cut
        topo.heal()
        assert topo.rules(0) == [] and topo.rules(1) == []
        assert connect(topo, 0, 1).startswith("ok")
        topo.partition(1, 0, mode="reject")
        start = time.monotonic()
        assert connect(topo, 0, 1, timeout=5) == "ConnectionRefusedError"
        assert time.monotonic() - start < 4  # refused at once, not a timeout
        topo.heal()
        assert connect(topo, 0, 1).startswith("ok")


def test_loss_drops_a_fraction_of_packets():
    udp = textwrap.dedent("""
        import socket, sys, time
        if sys.argv[1] == "recv":
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[2], 5556)); s.settimeout(1.0)
            print("ready", flush=True); n = 0
            try:
                while True:
                    s.recv(16); n += 1
            except OSError:
                print(n)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            for _ in range(400):
                s.sendto(b"x", (sys.argv[2], 5556)); time.sleep(0.0005)
    """)
    with Topology(2) as topo:
        topo.loss(1, 0.5)
        rx = topo.run_in(1, [sys.executable, "-c", udp, "recv", topo.address(1)], stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        topo.run_in(0, [sys.executable, "-c", udp, "send", topo.address(1)]).wait(timeout=30)
        got = int(rx.communicate(timeout=30)[0])
        assert 120 < got < 280, got  # binomial(400, 0.5): far outside 6 sigma otherwise
        with pytest.raises(ValueError, match="probability"):
            topo.loss(0, 1.5)
        with pytest.raises(ValueError, match="mode"):
            topo.partition(0, 1, mode="slow")


def test_kill_node_kills_every_process_of_that_node_only():
    tree = "sleep 300 & sleep 300 & wait"  # a parent with children, like an agent with workers
    with Topology(2) as topo:
        victim = topo.run_in(1, ["bash", "-c", tree])
        bystander = topo.run_in(0, ["bash", "-c", tree])
        from hp.testing import wait_for
        wait_for(lambda: len(topo.pids(1)) == 3 and len(topo.pids(0)) == 3, 10, "processes")
        assert topo.kill_node(1) == 3
        assert victim.wait(timeout=5) == -9
        assert topo.pids(1) == [] and bystander.poll() is None and len(topo.pids(0)) == 3


def test_exit_cleans_up_everything_even_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with Topology(2) as topo:
            proc = topo.run_in(0, ["sleep", "300"])
            names, bridge = [topo.netns(0), topo.netns(1)], topo.bridge
            raise RuntimeError("boom")
    assert proc.poll() == -9
    assert not any(os.path.exists(os.path.join(topology.NETNS_DIR, n)) for n in names)
    assert bridge not in links()


def test_cleanup_stale_removes_only_leftovers_of_dead_owners(tmp_path):
    crash = textwrap.dedent("""
        import os, subprocess
        from hp.chaos.topology import Topology
        t = Topology(2).start()
        t.run_in(1, ["sleep", "300"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(t.netns(0), t.netns(1), t.bridge, flush=True)
        os._exit(1)  # crash: no cleanup
    """)
    out = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60)
    leftovers = out.stdout.split()
    assert len(leftovers) == 3, out.stderr
    with Topology(1) as live:
        assert all(os.path.exists(os.path.join(topology.NETNS_DIR, n)) for n in leftovers[:2])
        stale_pids = topology.pids_in_netns(os.path.join(topology.NETNS_DIR, leftovers[1]))
        assert len(stale_pids) == 1
        removed = cleanup_stale()
        assert set(leftovers) <= set(removed)
        assert live.netns(0) not in removed and os.path.exists(live.netns_path(0))  # its owner is alive
        assert live.bridge in links()
    assert not any(os.path.exists(os.path.join(topology.NETNS_DIR, n)) for n in leftovers[:2])
    assert leftovers[2] not in links()
    assert gone(stale_pids[0])


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie waiting for a parent that is not ours to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True

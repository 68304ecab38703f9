"""Several "nodes" on one host: one Linux network namespace per node, and faults between them.

Agreed API (used by hp-chaos scenarios and multi-node tests)::

    with Topology(2) as topo:                 # namespaces + veths + a bridge, ~0.1 s per node
        topo.address(0)                        # "10.213.7.1": node 0's address
        topo.ifname(0)                         # "eth0": set GLOO_SOCKET_IFNAME to it
        p = topo.run_in(0, argv, env)          # subprocess.Popen inside node 0's namespace
        topo.partition(0, 1, mode="drop")      # or "reject" (TCP reset / ICMP unreachable)
        topo.loss(1, 0.05)                     # drop 5 % of packets to and from node 1
        topo.heal()                            # remove every partition and loss rule
        topo.kill_node(1)                      # SIGKILL every process in node 1's namespace at once
        topo.host_address()                    # "10.213.7.254": the host's own address on the bridge
    # exit: every process in the namespaces is killed, namespaces, veths and bridge are deleted

Each node is a namespace ``hpt-<owner pid>-<tag>-n<i>`` with a veth ``eth0`` (address ``.i+1`` of a
random 10.x.y.0/24) plugged into a bridge ``hpt<tag>`` on the host. The random tag and subnet make
two instances (``pytest -n 2``) independent. :meth:`Topology.host_address` gives the host an
address on the bridge (``.254``, added on first use): a server the host runs there (the chaos
runner's etcd) is reachable from every node and outside every node's failure domain, and node
faults (partitions and loss act between node addresses) leave it alone. Fault rules are iptables rules inside the node
namespaces, in a chain of their own, so deleting a namespace deletes its rules: nothing is ever
added to the host's tables. Partitions and loss act on *incoming* packets (both sides get a rule):
senders see no local error, exactly like a dead switch port. The kernel here has no ``tc netem``:
delay and jitter are not offered.

Processes are started with ``nsenter --net=...`` rather than ``ip netns exec`` (which remounts
/sys; INFRA.md). A process belongs to a node when its network namespace is the node's, whoever
started it, so :meth:`Topology.kill_node` also gets an agent's workers and spares.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and ``ip``, ``iptables``, ``nsenter``
(``scripts/setup.sh`` installs them on Debian). :func:`cleanup_stale` removes what a crashed run
left behind: only objects of this harness (``hpt`` prefix) whose owner process is gone.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

from hp.core.worker_signals import pid_alive

PREFIX = "hpt"
NETNS_DIR = "/var/run/netns"
_ALIAS = "hp-topology owner="
_CHAIN = "HP-FAULT"
_MODES = ("drop", "reject")


class TopologyError(RuntimeError):
    """The topology cannot be built or a fault cannot be applied; the message says why."""


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise TopologyError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def check_available() -> None:
    """Raise :class:`TopologyError` naming what is missing (root, ip, iptables, nsenter)."""
    missing = [tool for tool in ("ip", "iptables", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise TopologyError(f"network namespaces need {', '.join(missing)} "
                            "(apt-get install iproute2 iptables util-linux)")
    if os.geteuid() != 0:
        raise TopologyError("network namespaces need root (CAP_NET_ADMIN)")


def _ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def pids_in_netns(path: str) -> list[int]:
    """Every process whose network namespace is the one at ``path`` (a /var/run/netns entry)."""
    inode = _ns_inode(path)
    found = []
    if inode is None:
        return found
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_inode(f"/proc/{entry}/ns/net") == inode and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def _kill_netns_processes(path: str) -> set[int]:
    """SIGSTOP everything in the namespace first (no process can react to a neighbour's death,
    e.g. an agent reporting its dying workers), then SIGKILL; repeated until nothing is left."""
    killed: set[int] = set()
    for _ in range(50):
        pids = pids_in_netns(path)
        if not pids:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        killed.update(pids)
        time.sleep(0.01)
    return killed


class Topology:
    """``nodes`` network namespaces on one bridge. A context manager; see the module docstring."""

    def __init__(self, nodes: int, ifname: str = "eth0") -> None:
        if nodes < 1:
            raise ValueError(f"a topology needs >= 1 node, got {nodes}")
        check_available()
        self.nodes = nodes
        self._ifname = ifname
        rng = random.Random(os.urandom(8))
        self.tag = f"{rng.getrandbits(24):06x}"
        self.subnet = f"10.{rng.randrange(200, 250)}.{rng.randrange(0, 256)}"
        self.bridge = f"{PREFIX}{self.tag}"
        self._names = [f"{PREFIX}-{os.getpid()}-{self.tag}-n{i}" for i in range(nodes)]
        self._procs: list[tuple[int, subprocess.Popen]] = []  # (node, process) started by run_in
        self._started = False
        self._host_address = False  # host_address() put <subnet>.254 on the bridge

    # ---- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Topology:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Topology:
        self._started = True
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "alias", f"{_ALIAS}{os.getpid()}", "up"])
            for i, name in enumerate(self._names):
                host_end, node_end = f"{self.bridge}h{i}", f"{self.bridge}n{i}"
                _run(["ip", "netns", "add", name])
                _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end, "netns", name])
                _run(["ip", "link", "set", host_end, "alias", f"{_ALIAS}{os.getpid()}", "master", self.bridge, "up"])
                # one command per namespace: rename the node end, address it, bring it and lo up
                batch = (f"link set {node_end} name {self._ifname}\n"
                         f"addr add {self.address(i)}/24 dev {self._ifname}\n"
                         f"link set {self._ifname} up\nlink set lo up\n")
                proc = subprocess.run(["ip", "-n", name, "-batch", "-"], input=batch, capture_output=True, text=True)
                if proc.returncode:
                    raise TopologyError(f"configuring {name} failed: {proc.stderr.strip()}")
                self._iptables(i, "-N", _CHAIN)
                self._iptables(i, "-I", "INPUT", "-j", _CHAIN)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process in the namespaces, then delete namespaces (their veths and iptables
        rules go with them) and the bridge. Safe to call twice and after a failed start."""
        if not self._started:
            return
        for i in range(self.nodes):
            self.kill_node(i)
        for _, p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for i, name in enumerate(self._names):
            # deleting the host end deletes the pair now; a namespace's veths otherwise linger a while
            _run(["ip", "link", "del", f"{self.bridge}h{i}"], check=False)
            if os.path.exists(os.path.join(NETNS_DIR, name)):
                _run(["ip", "netns", "del", name], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)  # with the host's address on it, if any
        self._started = self._host_address = False

    # ---- nodes --------------------------------------------------------------------------
    def netns(self, i: int) -> str:
        return self._names[self._check(i)]

    def netns_path(self, i: int) -> str:
        return os.path.join(NETNS_DIR, self.netns(i))

    def address(self, i: int) -> str:
        return f"{self.subnet}.{self._check(i) + 1}"

    def host_address(self) -> str:
        """The host's address on the bridge (``<subnet>.254``), added the first time it is asked for:
        what a server on the host binds to for every node to reach it (deleting the bridge removes it)."""
        address = f"{self.subnet}.254"
        if not self._started:
            raise TopologyError("the topology is not started: no bridge to put the host's address on")
        if not self._host_address:
            taken = _run(["ip", "-o", "-4", "addr", "show"]).stdout
            if f" {self.subnet}." in taken:  # another topology (or anything else) uses this /24 on the host
                raise TopologyError(f"{self.subnet}.0/24 is already in use on the host: cannot add "
                                    f"{address} to {self.bridge}")
            _run(["ip", "addr", "add", f"{address}/24", "dev", self.bridge])
            self._host_address = True
        return address

    def ifname(self, i: int) -> str:
        """The node's interface: what ``GLOO_SOCKET_IFNAME`` must name for gloo to use it."""
        self._check(i)
        return self._ifname

    def run_in(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None,
               **popen_kw) -> subprocess.Popen:
        """Start ``argv`` inside node ``i``'s namespace (nsenter execs it: the Popen is the process)."""
        proc = subprocess.Popen(["nsenter", f"--net={self.netns_path(i)}", "--", *argv], env=env, **popen_kw)
        self._procs.append((i, proc))
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process now in node ``i``'s namespace."""
        return pids_in_netns(self.netns_path(i))

    def kill_node(self, i: int) -> int:
        """SIGKILL every process in node ``i`` together (agent, workers, spares); returns how many."""
        killed = _kill_netns_processes(self.netns_path(i))
        for node, p in self._procs:
            # one started a moment ago may still be nsenter, not yet inside the namespace
            if node == i and p.poll() is None:
                p.kill()
                p.wait()
                killed.add(p.pid)
        return len(killed)

    # ---- network faults -----------------------------------------------------------------
    def partition(self, a: int, b: int, mode: str = "drop") -> None:
        """Cut nodes ``a`` and ``b`` apart, both directions. ``drop``: packets vanish (peers notice
        only by timeout); ``reject``: TCP gets a reset, anything else ICMP port-unreachable."""
        if mode not in _MODES:
            raise ValueError(f"partition mode must be one of {_MODES}, got {mode!r}")
        if self._check(a) == self._check(b):
            raise ValueError(f"cannot partition node {a} from itself")
        for here, there in ((a, b), (b, a)):
            src = ["-s", self.address(there)]
            if mode == "drop":
                self._iptables(here, "-A", _CHAIN, *src, "-j", "DROP")
            else:  # the peer's own rejections (resets, ICMP errors) must get through to be noticed
                self._iptables(here, "-A", _CHAIN, *src, "-p", "tcp", "--tcp-flags", "RST", "RST", "-j", "RETURN")
                self._iptables(here, "-A", _CHAIN, *src, "-p", "icmp", "-j", "RETURN")
                self._iptables(here, "-A", _CHAIN, *src, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset")
                self._iptables(here, "-A", _CHAIN, *src, "-j", "REJECT")

    def loss(self, i: int, probability: float) -> None:
        """Drop each packet to or from node ``i`` with ``probability`` (independently)."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"loss probability must be in [0, 1], got {probability}")
        rule = ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.6f}", "-j", "DROP"]
        self._iptables(i, "-A", _CHAIN, "-i", self.ifname(i), *rule)
        for other in range(self.nodes):
            if other != i:
                self._iptables(other, "-A", _CHAIN, "-s", self.address(i), *rule)

    def heal(self) -> None:
        """Remove every partition and loss rule."""
        for i in range(self.nodes):
            self._iptables(i, "-F", _CHAIN)

    def rules(self, i: int) -> list[str]:
        """The fault rules now active in node ``i`` (``iptables -S`` lines)."""
        out = self._iptables(i, "-S", _CHAIN).stdout.splitlines()
        return [line for line in out if line.startswith("-A ")]

    # ---- internals ----------------------------------------------------------------------
    def _check(self, i: int) -> int:
        if not isinstance(i, int) or not 0 <= i < self.nodes:
            raise IndexError(f"node {i!r} outside [0, {self.nodes})")
        return i

    def _iptables(self, i: int, *args: str) -> subprocess.CompletedProcess:
        # -w: wait for the xtables lock instead of failing when another namespace's call holds it
        return _run(["nsenter", f"--net={self.netns_path(i)}", "--", "iptables", "-w", "5", *args])


def cleanup_stale() -> list[str]:
    """Delete namespaces and links this harness created for an owner process that no longer
    exists (a crashed or SIGKILLed test run), killing processes still inside. Returns their names."""
    removed = []
    for name in sorted(os.listdir(NETNS_DIR)) if os.path.isdir(NETNS_DIR) else []:
        parts = name.split("-")
        if len(parts) == 4 and parts[0] == PREFIX and parts[1].isdigit() and not pid_alive(int(parts[1])):
            _kill_netns_processes(os.path.join(NETNS_DIR, name))
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    links = json.loads(_run(["ip", "-j", "-d", "link", "show"]).stdout or "[]")
    for link in links:
        alias = link.get("ifalias", "")
        if link["ifname"].startswith(PREFIX) and alias.startswith(_ALIAS):
            owner = alias[len(_ALIAS):]
            if owner.isdigit() and not pid_alive(int(owner)):
                _run(["ip", "link", "del", link["ifname"]], check=False)
                removed.append(link["ifname"])
    return removed

"""Configuration of ``hp run`` and ``hp controller``: typed dataclasses, validated up front."""

from __future__ import annotations

import ipaddress
import os
import re
import uuid
from dataclasses import dataclass, field

from hp.core.errors import UsageError
from hp.core.services import parse_service_spec

DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str, flag: str = "--rdzv-endpoint") -> Endpoint:
    """``host:port`` or ``[ipv6]:port``; a clear :class:`UsageError` for anything else."""
    bad = UsageError(f"{flag}: expected HOST:PORT (e.g. 10.0.0.1:29400), got {text!r}")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise bad
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad from None
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host or ":" in host or any(c.isspace() or c in "/?#@" for c in host):
            raise bad
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise bad
    return Endpoint(host, int(port))


def parse_nnodes(text: str) -> tuple[int, int | None]:
    """``--nnodes N`` or, as torchrun spells an elastic job, ``MIN:MAX``; returns (MIN, MAX or None)."""
    low, sep, high = text.partition(":")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise UsageError(f"--nnodes: expected N or MIN:MAX (e.g. 2:4), got {text!r}")
    return int(low), int(high) if sep else None


NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")


MAX_NPROC_PER_NODE = 1024  # workers (or spares) one agent starts: more than any node has cores or GPUs
MAX_NODES = 65536
MAX_SECONDS = 7 * 24 * 3600.0  # a week: any longer timeout or interval is a typo


def check_seconds(value: float, flag: str, zero_ok: bool = False) -> float:
    """A duration flag: finite, > 0 (>= 0 with ``zero_ok``: 0 means never), at most a week; else a one-line error."""
    if not (value == value and (0 <= value if zero_ok else 0 < value) and value <= MAX_SECONDS):
        raise UsageError(f"{flag} must be {'>= 0' if zero_ok else '> 0'} seconds and at most {MAX_SECONDS:g}, got {value}")
    return value


def check_port(value: int, flag: str) -> int:
    if not 0 <= value <= 65535:
        raise UsageError(f"{flag} must be in [0, 65535], got {value}")
    return value


def check_name(value: str, what: str) -> str:
    """A name that becomes a path component (run id, checkpoint namespace, scenario name): letters,
    digits, ``_ . -``, at most 128, not ``.`` or ``..``; else a one-line :class:`UsageError`."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value) or value in (".", ".."):
        raise UsageError(f"{what} must be 1-128 of [A-Za-z0-9_.-] and not '.' or '..', got {value!r}")
    return value


@dataclass
class RunConfig:
    """Everything one ``hp run`` (one node's agent) needs. Mirrors torchrun where it applies."""

    entrypoint: str
    args: list[str] = field(default_factory=list)
    module: bool = False  # run ``entrypoint`` as ``python -m entrypoint``
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    rdzv_endpoint: Endpoint | None = None  # the controller; None: node 0 hosts it on loopback
    external_controller: bool = False  # a standalone ``hp controller`` runs the job; do not host one
    max_restarts: int = 0
    monitor_interval_s: float = 0.1
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    hang_timeout_s: float = 30.0  # a worker silent this long is killed (0: never); hp.checkpointless beats
    rdzv_timeout_s: float = 300.0
    log_dir: str | None = None
    tee: int = 3  # torch.distributed.elastic Std bitmask: 1 stdout, 2 stderr, 3 both
    spares: int = 0
    # workers and spares forked from one pre-imported process per node, or each started cold by torch
    # elastic ("spawn", as torchrun); replacement spares are always forked (hp.core.forkserver)
    start_method: str = "forkserver"
    # start a new hot spare whenever one of this node's spares is given a rank (off by default: on
    # a small node the new process's start competes with the survivors replaying the failed step)
    replenish_spares: bool = False
    transport: str = "gloo"
    store: str = "tcp"
    # node services (``NAME[:KEY=VALUE,...]``) started before the workers and stopped after them
    services: list[str] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # elastic (``--nnodes MIN:MAX`` + ``--scaling-policy FILE``): the job starts with ``nnodes`` nodes,
    # more may join up to ``max_nnodes``; the policy file is read by the ``hp_scaler`` hook (hp-elastic)
    max_nnodes: int | None = None
    scaling_policy: str | None = None
    grace_period_s: float = 30.0  # SIGTERM (preemption): how long this node's ranks get to leave gracefully
    scheduler: str = "local"  # the scheduler backend whose capacity an elastic job follows
    capacity_file: str | None = None  # the ``local`` backend's capacity source (a number of ranks)
    # HA (``--store etcd --rdzv-endpoint ETCD[,ETCD...]``): the etcd cluster that holds the job's keys and
    # its controller's state; every agent runs a controller replica (hp.core.leader) and none hosts a store
    store_endpoint: str | None = None
    controller_port: int = 0  # HA: where this node's replica serves the controller when it leads (0: any)
    controller_lease_s: int = 2  # HA: TTL of the controller's lease in etcd (whole seconds): the failover time
    # the node's relay of generations to its workers (hp.core.fanout); off: each worker polls the store
    node_relay: bool = True

    def worker_thread_env(self) -> dict[str, str]:
        """What the workers' environment adds for threads (the fork server's too: hp.core.fork_context)."""
        if self.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            return {"OMP_NUM_THREADS": "1"}  # as torchrun: N ranks on one host must not oversubscribe
        return {}

    def validate(self) -> None:
        check_name(self.run_id, "--run-id")
        checks = [
            (self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}"),
            (self.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {self.nproc_per_node}"),
            (self.spares >= 0, f"--spares must be >= 0, got {self.spares}"),
            (0 <= self.node_rank < max(self.nnodes, self.max_nnodes or 0),
             f"--node-rank must be in [0, {max(self.nnodes, self.max_nnodes or 0)}), got {self.node_rank}"),
            (self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}"),
            (self.monitor_interval_s > 0, "--monitor-interval must be > 0"),
            (self.heartbeat_timeout_s > self.heartbeat_interval_s > 0,
             "--heartbeat-timeout must exceed the heartbeat interval"),
            (self.tee in (0, 1, 2, 3), f"--tee must be 0, 1, 2 or 3, got {self.tee}"),
            (self.start_method in ("forkserver", "spawn"),
             f"--start-method must be forkserver or spawn, got {self.start_method!r}"),
            (self.hang_timeout_s >= 0, f"--hang-timeout must be >= 0, got {self.hang_timeout_s}"),
            (bool(self.entrypoint), "a training script (or -m module) is required"),
            (self.max_nnodes is None or self.max_nnodes >= self.nnodes,
             f"--nnodes MIN:MAX needs MIN <= MAX, got {self.nnodes}:{self.max_nnodes}"),
            (self.grace_period_s > 0, f"--grace-period must be > 0, got {self.grace_period_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        for flag, count, most in (("--nnodes", max(self.nnodes, self.max_nnodes or 0), MAX_NODES),
                                  ("--nproc-per-node", self.nproc_per_node, MAX_NPROC_PER_NODE),
                                  ("--spares", self.spares, MAX_NPROC_PER_NODE)):
            if count > most:  # one agent's memory grows with these: bound them before anything starts
                raise UsageError(f"{flag} must be at most {most}, got {count}")
        for flag, value in (("--monitor-interval", self.monitor_interval_s), ("--heartbeat-interval", self.heartbeat_interval_s),
                            ("--heartbeat-timeout", self.heartbeat_timeout_s), ("--hang-timeout", self.hang_timeout_s),
                            ("--rdzv-timeout", self.rdzv_timeout_s), ("--grace-period", self.grace_period_s)):
            check_seconds(value, flag, zero_ok=flag == "--hang-timeout")
        if self.scaling_policy is not None and not os.path.isfile(self.scaling_policy):
            raise UsageError(f"--scaling-policy: no such file: {self.scaling_policy}")
        for spec in self.services:
            parse_service_spec(spec)
        if self.ha:
            if self.store != "etcd":
                raise UsageError(f"an HA controller keeps its state in etcd: --store etcd, not {self.store!r}")
            if self.external_controller:
                raise UsageError("--external-controller and --store etcd: the agents elect the controller "
                                 "themselves (run standalone `hp controller --store etcd` replicas instead)")
            if not 1 <= self.controller_lease_s < self.fence_after_s:
                raise UsageError(f"--controller-lease must be >= 1 and shorter than an agent's fencing deadline "
                                 f"({self.fence_after_s:g} s: raise --heartbeat-timeout), got {self.controller_lease_s}")
            check_port(self.controller_port, "--controller-port")
            return
        multi_node = self.nnodes > 1 or self.external_controller or (self.max_nnodes or 1) > 1
        if multi_node and (self.rdzv_endpoint is None or self.rdzv_endpoint.port == 0):
            raise UsageError("--rdzv-endpoint HOST:PORT with a fixed port is required when "
                             "--nnodes > 1 or the controller is external")

    @property
    def fence_after_s(self) -> float:
        """Seconds without an answered heartbeat after which the agent kills its workers and exits.
        Shorter than the controller's timeout by two heartbeats (and counted from the *send* time of
        the last answered beat): a cut-off node is dead before its ranks are given to other nodes."""
        return max(self.heartbeat_interval_s, self.heartbeat_timeout_s - 2 * self.heartbeat_interval_s)

    @property
    def ha(self) -> bool:
        """Whether the agents elect the controller among themselves (:mod:`hp.core.leader`)."""
        return self.store_endpoint is not None

    @property
    def hosts_controller(self) -> bool:
        """Whether this node's agent hosts the (only) controller and its store: node 0's, unless the
        controller is external or HA (then every agent runs a replica and none hosts it for good)."""
        return self.node_rank == 0 and not self.external_controller and not self.ha

    @property
    def controller_endpoint(self) -> Endpoint:
        return self.rdzv_endpoint or Endpoint(DEFAULT_HOST, 0)

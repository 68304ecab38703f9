"""Configuration of ``hp run`` and ``hp controller``: typed dataclasses, validated up front."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import uuid
from dataclasses import MISSING, dataclass, field, fields

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


def option(default, *flags: str, help: str, **argparse_kwargs):  # noqa: A002 (argparse's name)
    """A config field that is also an ``hp run`` flag: ``flags`` and ``help`` (and any other
    ``add_argument`` keyword) travel in the field's metadata; :func:`add_section_flags` adds them."""
    meta = {"flags": flags, "help": help, **argparse_kwargs}
    if isinstance(default, list):
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class LaunchConfig:
    """What runs, and on how many nodes and processes (torchrun's own flags where it has them)."""

    entrypoint: str = ""  # the training script, or a module with ``module`` (the positional argument)
    args: list[str] = field(default_factory=list)
    module: bool = False  # run ``entrypoint`` as ``python -m entrypoint`` (-m)
    nnodes: int = 1  # --nnodes N (or MIN of MIN:MAX: elastic.max_nnodes)
    nproc_per_node: int = option(1, "--nproc-per-node", "--nproc_per_node", type=int, help="workers on this node")
    node_rank: int = option(0, "--node-rank", "--node_rank", type=int, help="this node's rank in [0, nnodes)")
    # workers and spares forked from one pre-imported process per node, or each started cold by torch
    # elastic ("spawn", as torchrun); replacement spares are always forked (hp.core.forkserver)
    start_method: str = option(
        "forkserver", "--start-method", choices=("forkserver", "spawn"),
        help="how workers and spares start: forked from one process per node that imported torch once "
             "(default), or each a new interpreter through torch elastic, as torchrun starts them")
    transport: str = option("gloo", "--transport", help="collective transport plugin (see `hp backends`)")
    # node services (``NAME[:KEY=VALUE,...]``) started before the workers and stopped after them
    services: list[str] = option(
        [], "--service", action="append", metavar="NAME[:KEY=VALUE,...]",
        help="start a node service beside the workers (repeatable; see `hp backends`, family "
             "node_service), e.g. --service ckpt:replicas=1 for hp-tiered-ckpt's checkpoint daemon")
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # --run-id (default: random)


@dataclass
class FaultToleranceConfig:
    """How failures are seen and what answers them: restarts, hot spares, heartbeats, hang detection."""

    max_restarts: int = option(0, "--max-restarts", "--max_restarts", type=int, help="worker restarts the job tolerates")
    spares: int = option(0, "--spares", type=int,
                         help="hot spare processes on this node, given a failed rank (scripts using hp.checkpointless)")
    # start a new hot spare whenever one of this node's spares is given a rank (off by default: on
    # a small node the new process's start competes with the survivors replaying the failed step)
    replenish_spares: bool = option(
        False, "--replenish-spares", action=argparse.BooleanOptionalAction,
        help="start a new spare each time one of this node's spares takes a rank (default off: the "
             "new process's start competes for CPU with the ranks replaying the failed step)")
    monitor_interval_s: float = option(0.1, "--monitor-interval", "--monitor_interval", type=float,
                                       help="seconds between worker polls")
    heartbeat_interval_s: float = option(1.0, "--heartbeat-interval", type=float, help="seconds between agent heartbeats")
    heartbeat_timeout_s: float = option(
        30.0, "--heartbeat-timeout", type=float,
        help="seconds of silence before a node counts as lost (its ranks go to spares on other nodes); "
             "an agent cut off from the controller kills its workers two heartbeats earlier")
    hang_timeout_s: float = option(30.0, "--hang-timeout", type=float,  # hp.checkpointless beats
                                   help="kill a worker whose hp heartbeat is silent this long (0: never)")

    @property
    def fence_after_s(self) -> float:
        """Seconds without an answered heartbeat after which the agent kills its workers and exits.
        Shorter than the controller's timeout by two heartbeats (and counted from the *send* time of
        the last answered beat): a cut-off node is dead before its ranks are given to other nodes."""
        return max(self.heartbeat_interval_s, self.heartbeat_timeout_s - 2 * self.heartbeat_interval_s)


@dataclass
class ElasticConfig:
    """An elastic job (``--nnodes MIN:MAX`` + ``--scaling-policy FILE``): it starts with ``nnodes`` nodes and
    more may join up to ``max_nnodes``; the policy file is read by the ``hp_scaler`` hook (hp-elastic)."""

    max_nnodes: int | None = None  # MAX of --nnodes MIN:MAX
    scaling_policy: str | None = option(
        None, "--scaling-policy", metavar="FILE",
        help="elastic training: a ScalingPolicy YAML file (hp-elastic): shrink instead of stopping when a "
             "rank dies with no spare, grow into joining nodes, leave gracefully on SIGTERM")
    grace_period_s: float = option(
        30.0, "--grace-period", type=float,
        help="elastic: seconds this node's ranks get after SIGTERM to leave at a step boundary (or, where the "
             "job cannot go on without the node, to save their last committed step before the job stops)")
    scheduler: str = "local"  # the scheduler backend whose capacity an elastic job follows
    capacity_file: str | None = option(
        None, "--capacity-file", metavar="FILE",
        help="elastic, node hosting the controller: follow the number of ranks written in FILE (the local "
             "scheduler's capacity source; `hp scale` is the other way to set it)")


@dataclass
class RendezvousConfig:
    """Where the job meets: the controller, the coordination store, and how workers follow generations."""

    store: str = option("tcp", "--store", help="coordination store plugin")
    rdzv_endpoint: Endpoint | None = None  # the controller (--rdzv-endpoint); None: node 0 hosts it on loopback
    # HA (``--store etcd --rdzv-endpoint ETCD[,ETCD...]``): the etcd cluster that holds the job's keys and
    # its controller's state; every agent runs a controller replica (hp.core.leader) and none hosts a store
    store_endpoint: str | None = None
    external_controller: bool = option(False, "--external-controller", action="store_true",
                                       help="a standalone `hp controller` runs this job")
    rdzv_timeout_s: float = option(300.0, "--rdzv-timeout", type=float, help="seconds to wait for every node to join")
    controller_port: int = option(
        0, "--controller-port", type=int,
        help="--store etcd: the port this node serves the controller on when elected (default: any free one)")
    controller_lease_s: int = option(
        2, "--controller-lease", type=int,
        help="--store etcd: seconds of the controller's lease in etcd: a standby takes over this long after "
             "the leader's node dies")
    # the node's relay of generations to its workers (hp.core.fanout); off: each worker polls the store
    node_relay: bool = option(
        True, "--node-relay", action=argparse.BooleanOptionalAction,
        help="workers learn new generations from this node's agent (one blocking watcher of the store per node, "
             "hp.core.fanout; the default) instead of each polling the store (--no-node-relay)")

    @property
    def ha(self) -> bool:
        """Whether the agents elect the controller among themselves (:mod:`hp.core.leader`)."""
        return self.store_endpoint is not None

    @property
    def controller_endpoint(self) -> Endpoint:
        return self.rdzv_endpoint or Endpoint(DEFAULT_HOST, 0)


@dataclass
class LoggingConfig:
    """Where the workers' output goes."""

    log_dir: str | None = option(None, "--log-dir", "--log_dir", help="worker logs go to LOG_DIR/rank<R>/attempt_<k>/")
    tee: int = option(3, "--tee", type=int,  # torch.distributed.elastic Std bitmask
                      help="streams echoed with a [rankN]: prefix: 0 none, 1 out, 2 err, 3 both")


SECTIONS = {"launch": LaunchConfig, "fault_tolerance": FaultToleranceConfig, "elastic": ElasticConfig,
            "rendezvous": RendezvousConfig, "logging": LoggingConfig}


def add_section_flags(parser: argparse.ArgumentParser, name: str, section: type) -> None:
    """The flags of ``section``'s fields (those declared with :func:`option`), in declaration order, as one
    group of the help (titled ``name``, described by the section's docstring)."""
    group = parser.add_argument_group(name.replace("_", " "), (section.__doc__ or "").split("\n\n")[0].replace("``", ""))
    for f in fields(section):
        if "flags" in f.metadata:
            kwargs = {k: v for k, v in f.metadata.items() if k != "flags"}
            if "action" not in kwargs and "choices" not in kwargs:
                kwargs.setdefault("metavar", f.metadata["flags"][0].lstrip("-").upper().replace("-", "_"))
            default = f.default_factory() if f.default is MISSING else f.default
            group.add_argument(*f.metadata["flags"], dest=f.name, default=default, **kwargs)


def section_from_args(section: type, parsed: argparse.Namespace, given: dict | None = None):
    """``section`` from the parsed flags of its fields, plus ``given`` (the fields parsed by hand)."""
    values = {f.name: getattr(parsed, f.name) for f in fields(section) if "flags" in f.metadata}
    return section(**values, **(given or {}))


@dataclass
class RunConfig:
    """Everything one ``hp run`` (one node's agent) needs, in documented sections (torchtitan's JobConfig
    style): each section's fields generate their ``hp run`` flags (:func:`add_section_flags`)."""

    launch: LaunchConfig = field(default_factory=LaunchConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def worker_thread_env(self) -> dict[str, str]:
        """What the workers' environment adds for threads (the fork server's too: hp.core.fork_context)."""
        if self.launch.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            return {"OMP_NUM_THREADS": "1"}  # as torchrun: N ranks on one host must not oversubscribe
        return {}

    def validate(self) -> None:
        la, ft, el, rv, lg = self.launch, self.fault_tolerance, self.elastic, self.rendezvous, self.logging
        check_name(la.run_id, "--run-id")
        checks = [
            (la.nnodes >= 1, f"--nnodes must be >= 1, got {la.nnodes}"),
            (la.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {la.nproc_per_node}"),
            (ft.spares >= 0, f"--spares must be >= 0, got {ft.spares}"),
            (0 <= la.node_rank < max(la.nnodes, el.max_nnodes or 0),
             f"--node-rank must be in [0, {max(la.nnodes, el.max_nnodes or 0)}), got {la.node_rank}"),
            (ft.max_restarts >= 0, f"--max-restarts must be >= 0, got {ft.max_restarts}"),
            (ft.monitor_interval_s > 0, "--monitor-interval must be > 0"),
            (ft.heartbeat_timeout_s > ft.heartbeat_interval_s > 0,
             "--heartbeat-timeout must exceed the heartbeat interval"),
            (lg.tee in (0, 1, 2, 3), f"--tee must be 0, 1, 2 or 3, got {lg.tee}"),
            (la.start_method in ("forkserver", "spawn"),
             f"--start-method must be forkserver or spawn, got {la.start_method!r}"),
            (ft.hang_timeout_s >= 0, f"--hang-timeout must be >= 0, got {ft.hang_timeout_s}"),
            (bool(la.entrypoint), "a training script (or -m module) is required"),
            (el.max_nnodes is None or el.max_nnodes >= la.nnodes,
             f"--nnodes MIN:MAX needs MIN <= MAX, got {la.nnodes}:{el.max_nnodes}"),
            (el.grace_period_s > 0, f"--grace-period must be > 0, got {el.grace_period_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        for flag, count, most in (("--nnodes", max(la.nnodes, el.max_nnodes or 0), MAX_NODES),
                                  ("--nproc-per-node", la.nproc_per_node, MAX_NPROC_PER_NODE),
                                  ("--spares", ft.spares, MAX_NPROC_PER_NODE)):
            if count > most:  # one agent's memory grows with these: bound them before anything starts
                raise UsageError(f"{flag} must be at most {most}, got {count}")
        for flag, value in (("--monitor-interval", ft.monitor_interval_s), ("--heartbeat-interval", ft.heartbeat_interval_s),
                            ("--heartbeat-timeout", ft.heartbeat_timeout_s), ("--hang-timeout", ft.hang_timeout_s),
                            ("--rdzv-timeout", rv.rdzv_timeout_s), ("--grace-period", el.grace_period_s)):
            check_seconds(value, flag, zero_ok=flag == "--hang-timeout")
        if el.scaling_policy is not None and not os.path.isfile(el.scaling_policy):
            raise UsageError(f"--scaling-policy: no such file: {el.scaling_policy}")
        for spec in la.services:
            parse_service_spec(spec)
        if rv.ha:
            if rv.store != "etcd":
                raise UsageError(f"an HA controller keeps its state in etcd: --store etcd, not {rv.store!r}")
            if rv.external_controller:
                raise UsageError("--external-controller and --store etcd: the agents elect the controller "
                                 "themselves (run standalone `hp controller --store etcd` replicas instead)")
            if not 1 <= rv.controller_lease_s < ft.fence_after_s:
                raise UsageError(f"--controller-lease must be >= 1 and shorter than an agent's fencing deadline "
                                 f"({ft.fence_after_s:g} s: raise --heartbeat-timeout), got {rv.controller_lease_s}")
            check_port(rv.controller_port, "--controller-port")
            return
        multi_node = la.nnodes > 1 or rv.external_controller or (el.max_nnodes or 1) > 1
        if multi_node and (rv.rdzv_endpoint is None or rv.rdzv_endpoint.port == 0):
            raise UsageError("--rdzv-endpoint HOST:PORT with a fixed port is required when "
                             "--nnodes > 1 or the controller is external")

    @property
    def hosts_controller(self) -> bool:
        """Whether this node's agent hosts the (only) controller and its store: node 0's, unless the
        controller is external or HA (then every agent runs a replica and none hosts it for good)."""
        return self.launch.node_rank == 0 and not self.rendezvous.external_controller and not self.rendezvous.ha

"""The job's book: the state every part of the controller reads and changes, and the request's words.

The controller is split by idea (:mod:`hp.core.controller`); its parts share one :class:`JobBook`, passed
to each when the controller is made, rather than reaching into each other: who holds which rank, in
which generation, on which node, with which spares. Also here, shared by every handler: the refusal
(:class:`Refused`) and the checks of a request's fields, so that a malformed request is refused in the
same words whichever part reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hp.core.controller.spares import SparePool
from hp.core.protocol import JobState

MAX_INCARNATION = 128  # characters of a node's incarnation (a pod uid has 36)


class Refused(Exception):
    """A request the controller will not act on; ``status`` follows HTTP meanings."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


@dataclass
class NodeRecord:
    node_rank: int
    nproc: int
    host: str
    spares: int = 0
    rank_offset: int = 0
    last_seen: float = 0.0
    done: bool = False
    lost: bool = False  # silent past the heartbeat timeout: its ranks went to spares elsewhere
    address: str = ""  # the address the agent reached the controller from (told to survivors)
    spare_ids: list[str] = field(default_factory=list)  # the ids of the spares its agent starts (after rendezvous)
    promotions: list[dict] = field(default_factory=list)  # spares of this node given a rank, not yet told
    forming_store: str = ""  # HOST:PORT of the TCPStore its agent hosts for forming process groups (HA), if any
    incarnation: str = ""  # what the scheduler calls this run of the node (a pod's uid): HP_NODE_INCARNATION


@dataclass
class ControllerConfig:
    nnodes: int
    max_restarts: int = 0  # worker restarts the whole job tolerates, as torchrun counts them
    heartbeat_timeout_s: float = 30.0
    store_host: str = "127.0.0.1"
    store_port: int = 0
    decision_log: str | None = None  # JSON-lines file; None keeps the log in memory only
    max_rank_exceptions: int = 2  # in-process recoveries one rank may cause before it is replaced
    max_nodes: int | None = None  # elastic (``--nnodes MIN:MAX``): node ranks up to this may join later


@dataclass
class JobBook:
    """What the job is now. Durable as a whole (:mod:`hp.core.controller.state`), except each node's
    ``last_seen``: a reading of this process's monotonic clock."""

    config: ControllerConfig
    generation: int = 0
    state: JobState = JobState.RENDEZVOUS
    reason: str = ""
    restarts: int = 0
    finishing: bool = False  # an operator asked the job to end at its next agreed step boundary (hp finish)
    nodes: dict[int, NodeRecord] = field(default_factory=dict)
    members: dict[int, int] = field(default_factory=dict)  # rank -> node_rank currently holding it
    holders: dict[int, str] = field(default_factory=dict)  # rank -> id of the process holding it (fences out old ones)
    rank_restarts: dict[int, int] = field(default_factory=dict)
    rank_exceptions: dict[int, int] = field(default_factory=dict)
    spares: SparePool = field(default_factory=SparePool)

    def require_running(self) -> None:
        if self.state is not JobState.RUNNING:
            raise Refused(409, f"job is {self.state.value}", state=self.state.value, reason=self.reason)

    def finished(self) -> bool:
        """Whether every rank's work is done: each node holding a rank finished (or was lost)."""
        holding = set(self.members.values()) or set(self.nodes)
        return all(self.nodes[n].done or self.nodes[n].lost for n in holding)

    def ranks_of(self, node_rank: int) -> list[int]:
        """The ranks ``node_rank`` holds, in ascending order."""
        return sorted(r for r, owner in self.members.items() if owner == node_rank)


def describe_exit(exitcode: int | None, signal_name: str | None) -> str:
    if signal_name:
        return f"was killed by {signal_name}"
    return f"exited with code {exitcode}"


def host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() or c in "/?#@" for c in host)


def request_field(payload: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    value = payload.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise Refused(400, f"malformed request: field {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


def incarnation_field(payload: dict) -> str:
    """A request's optional ``incarnation``: printable, at most :data:`MAX_INCARNATION` characters."""
    value = payload.get("incarnation", "")
    if not isinstance(value, str) or len(value) > MAX_INCARNATION or not value.isprintable():
        raise Refused(400, f"malformed request: field 'incarnation' must be a printable str of at most "
                           f"{MAX_INCARNATION} characters")
    return value


def text_field(payload: dict, name: str, default: str) -> str:
    """An optional free-text field (a reason, a message): ``default`` when absent or not a str."""
    value = payload.get(name)
    return value if isinstance(value, str) else default

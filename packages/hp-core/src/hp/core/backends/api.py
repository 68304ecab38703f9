"""The contracts of hp-core's backend families: what a plugin implements, apart from any implementation.

pluggy's pattern (eggsample, pytest): the hook specifications (:mod:`hp.core.hookspecs`) say which hook
returns which backends; this module says what those backends are; the built-in implementations
(:mod:`hp.core.store`, :mod:`hp.core.health`, :mod:`hp.core.transport`, :mod:`hp.core.services`' host)
import it, never the other way round. Two families keep their contracts beside their kin:
:mod:`hp.core.schedulers.api` (as torchx's ``schedulers/api.py``) and :mod:`hp.core.scaling` (hp-elastic's
side of the controller). Stdlib only, so that reading a contract imports neither torch nor pluggy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

from hp.core.errors import HpError

if TYPE_CHECKING:
    import torch.distributed as dist


# ---- store (family ``store``) ----------------------------------------------------------------
@dataclass
class StoreServer:
    """A running store server: where clients reach it, and how to stop it."""

    host: str
    port: int
    store: dist.Store
    _keepalive: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        for sock in self._keepalive:
            sock.close()
        self._keepalive.clear()
        self.store = None  # type: ignore[assignment]  # dropping the last reference stops the server


class StoreBackend:
    """Base class of store backends."""

    name: str = ""

    def serve(self, host: str, port: int = 0) -> StoreServer:
        """Start a server bound to ``host`` only (port 0 picks a free one)."""
        raise NotImplementedError

    def connect(self, host: str, port: int, timeout: timedelta = timedelta(seconds=60),
                job: str | None = None) -> dist.Store:
        """A client of the server at ``host:port``; ``job``: the job's keys where a store holds many jobs'."""
        raise NotImplementedError



# ---- transport (family ``transport``) ----------------------------------------------------------
class TransportBackend:
    """A collective transport (family ``transport``): builds the process group of one generation and tears
    a failed one down. Subclasses set ``name`` and ``torch_backend``; the built-ins share
    :class:`hp.core.transport.ProcessGroupTransport`."""

    name: str = ""
    torch_backend: str = ""

    def check_available(self) -> None:
        """Raise :class:`hp.core.errors.BackendUnavailableError` (a clear one-liner) if this machine cannot run it."""

    def env_defaults(self) -> dict[str, str]:
        """Environment variables the agent sets for workers unless the user already set them."""
        return {}

    def device_for(self, local_rank: int) -> str:
        """The torch device a worker with ``local_rank`` should compute on."""
        return "cpu"

    def init_process_group(self, store: dist.Store, rank: int, world_size: int, generation: int,
                           timeout: timedelta = timedelta(minutes=10), connect_timeout: timedelta | None = None) -> None:
        """Initialise the default process group of ``generation`` on a generation-prefixed store; its
        collectives time out after ``timeout``; ``connect_timeout`` bounds the wait for a peer that never connects."""
        raise NotImplementedError

    def new_subgroup(self, ranks: list[int], timeout: timedelta = timedelta(minutes=10),
                     connect_timeout: timedelta | None = None) -> dist.ProcessGroup:
        """A process group of ``ranks`` inside the current default group (one dimension of a device mesh)."""
        raise NotImplementedError

    def init_timeout(self, timeout: timedelta, connect_timeout: timedelta | None) -> timedelta:
        """The timeout to initialise the group with so that a first connect waits at most ``connect_timeout``."""
        return timeout

    def abort(self) -> None:
        """Tear down the default process group of a failed generation so that peers blocked in one of its
        collectives are released."""
        raise NotImplementedError


# ---- health (family ``health``) --------------------------------------------------------------
class HealthCheck:
    """Base class: ``name``, which devices it is for, and the check (no collectives: peers are re-forming)."""

    name: str = ""

    def applies(self, device: str) -> bool:
        """Whether this check is for ``device`` (``"cpu"``, ``"cuda:3"``, ...)."""
        return False

    def run(self, device: str) -> str | None:
        """None when healthy, else why not (one line)."""
        return None



# ---- node services (family ``node_service``) -------------------------------------------------
class ServiceError(HpError):
    """A node service could not start, or its counterparts never showed up."""


@dataclass(frozen=True)
class NodeContext:
    """What a service is told about the node it runs on."""

    run_id: str
    node_rank: int
    nnodes: int
    address: str  # this node's address as the other nodes (and the controller) see it: bind here
    log_dir: str  # the job's log directory on this node; a service logs under services/<name>
    token: str = field(repr=False)  # the job token: authenticate every connection with it
    options: dict[str, str] = field(default_factory=dict)  # from --service NAME:KEY=VALUE,...


class RunningService(Protocol):
    """One started service on this node."""

    @property
    def endpoint(self) -> str:
        """What the other nodes need to reach this service (e.g. ``HOST:PORT``); may be empty."""

    def connect(self, endpoints: list[str]) -> None:
        """Every node's endpoint, indexed by node rank (this node's included), once all are known."""

    def worker_env(self) -> dict[str, str]:
        """Environment variables for every worker and spare started on this node."""

    def poll(self) -> str | None:
        """None while the service runs; once it has ended, a one-line description of how."""

    def stop(self) -> None:
        """Stop the service and release what it holds. Called once, after the workers stopped."""


class NodeService(Protocol):
    """A backend of the ``node_service`` family."""

    name: str

    def start(self, node: NodeContext) -> RunningService:
        """Start this node's instance; raise :class:`ServiceError` (or ``UsageError`` for bad
        options) if it cannot run. Must return once the service accepts connections."""

"""The agent's link to the controller: reaching it (hosting it on node 0, or electing it among the agents
with HA) and every request under this node's fencing lease.

The lease: an agent that gets no answer from the controller for ``RunConfig.fence_after_s`` (two
heartbeats less than the controller's timeout) raises :class:`Fenced` from :meth:`Link.call`, so that no
rank of a cut-off node keeps training in a generation the job has left. No request may outlast the lease.
"""

from __future__ import annotations

import os
import socket
import time

from hp.core.agent.messages import say
from hp.core.config import RunConfig
from hp.core.control_plane import ControlClient, ControlServer
from hp.core.controller import Controller, ControllerConfig
from hp.core.errors import ControlPlaneError, HpError
from hp.core.plugins import get_backend
from hp.core.protocol import Verb
from hp.core.controller import ElasticController
from hp.core.scaling import Scaler
from hp.core.signed_values import sealing
from hp.core.store import StoreServer


class JobFailed(HpError):
    """The controller stopped the job; the message says which rank failed and why."""


class Rejoin(Exception):
    """HA: the controller that answered does not know this node (a new leader took over a rendezvous)."""


class Fenced(HpError):
    """This node lost the controller for longer than its lease: it must stop its workers."""


class Link:
    """This node's side of the control plane: the controller it hosts (if any), the client it calls it
    with, and the generation it stamps on every request."""

    def __init__(self, config: RunConfig, token: str, store_backend, scaler: Scaler | None, log_dir: str) -> None:
        self.cfg = config
        self.token = token
        self.store_backend = store_backend
        self.scaler = scaler
        self.log_dir = log_dir
        self.generation = 0
        self.address = ""  # this node's address as the controller sees it
        # the client once this node takes part (HA: from the moment a leader is reached; else once it monitors)
        self.client: ControlClient | None = None
        self.server: ControlServer | None = None
        self.store: StoreServer | None = None
        self.replica = None  # HA: this node's hp.core.leader.ControllerReplica
        self.forming: StoreServer | None = None  # HA: the TCPStore this node hosts for forming process groups
        self.last_ok = time.monotonic()  # send time of the last request the controller answered

    @property
    def hosts_controller(self) -> bool:
        return self.server is not None

    def catch_up(self, generation: int) -> None:
        self.generation = max(self.generation, generation)

    def start_lease(self, generation: int) -> None:
        """The rendezvous answered: this node takes part in ``generation``, its lease counted from now."""
        self.generation = generation
        self.last_ok = time.monotonic()

    # ---- reaching the controller ------------------------------------------------------------
    def connect(self) -> ControlClient:
        if self.cfg.rendezvous.ha:
            return self._join_replicas()
        if self.cfg.hosts_controller:
            self._host_controller()
            self.address = self.cfg.rendezvous.controller_endpoint.host
            say(f"controller at {self.server.endpoint}, store at {self.store.host}:{self.store.port}, "
                f"logs in {self.log_dir}")
            return ControlClient(self.server.endpoint, self.token, node=self.cfg.launch.node_rank)
        ep = self.cfg.rendezvous.controller_endpoint
        self.address = local_address(ep.host, ep.port)
        return ControlClient(str(ep), self.token, node=self.cfg.launch.node_rank)

    def _host_controller(self) -> None:
        ep = self.cfg.rendezvous.controller_endpoint
        self.store = self.store_backend.serve(ep.host, 0)
        publish = sealing(self.store.store.set, self.token)  # workers refuse values not sealed with the token
        controller = self._new_controller(self.store.host, self.store.port, publish)
        self.server = ControlServer(controller, self.token, ep.host, ep.port).start()

    def _new_controller(self, store_host: str, store_port: int, publish, persist=None) -> Controller:
        config = ControllerConfig(
            nnodes=self.cfg.launch.nnodes,
            max_nodes=self.cfg.elastic.max_nnodes,
            max_restarts=self.cfg.fault_tolerance.max_restarts,
            heartbeat_timeout_s=self.cfg.fault_tolerance.heartbeat_timeout_s,
            store_host=store_host,
            store_port=store_port,
            decision_log=os.path.join(self.log_dir, "controller_decisions.jsonl"),
        )
        if self.scaler is None:
            return Controller(config, publish=publish, persist=persist)
        return ElasticController(config, self.scaler, publish=publish, persist=persist)

    def _join_replicas(self) -> ControlClient:
        """HA: start this node's controller replica (hp.core.leader) and reach whichever replica leads."""
        from hp.core.etcd_store import DEFAULT_PORT, parse_endpoints
        from hp.core.leader import ControllerReplica, LeaderResolver

        endpoints = self.cfg.rendezvous.store_endpoint
        self.address = local_address(*parse_endpoints(endpoints)[0])
        # the controller names one live node's store per generation for its ranks to form their group on:
        # as fast as a TCPStore, hosted by no rank, and another node's once this one is lost
        self.forming = get_backend("store", "tcp").serve(self.address or "127.0.0.1", 0)
        store = self.store_backend.connect(endpoints, DEFAULT_PORT, job=self.cfg.launch.run_id)
        own = self.store_backend.connect(endpoints, DEFAULT_PORT, job=self.cfg.launch.run_id)  # the replica's thread's
        self.replica = ControllerReplica(
            own, self.token, lambda persist: self._new_controller(endpoints, DEFAULT_PORT, sealing(own.set, self.token),
                                                                  persist),
            host=self.address or "127.0.0.1", port=self.cfg.rendezvous.controller_port, node=self.cfg.launch.node_rank,
            ttl_s=self.cfg.rendezvous.controller_lease_s, say=say).start()
        resolver = LeaderResolver(store, self.token)
        endpoint = resolver.wait_for_other("", time.monotonic() + self.cfg.rendezvous.rdzv_timeout_s)
        if endpoint is None:
            raise JobFailed(f"no controller was elected within {self.cfg.rendezvous.rdzv_timeout_s:g} s (etcd at {endpoints})")
        say(f"controller elected among the agents, now at {endpoint} (etcd at {endpoints}, job {self.cfg.launch.run_id}); "
            f"logs in {self.log_dir}")
        self.client = ControlClient(endpoint, self.token, node=self.cfg.launch.node_rank, follow=resolver.wait_for_other)
        return self.client

    def forming_store(self) -> str | None:
        """HA: ``host:port`` of the store this node hosts for forming process groups."""
        return f"{self.forming.host}:{self.forming.port}" if self.forming is not None else None

    def endpoint(self) -> str:
        """The controller's endpoint a worker is told (``HP_CONTROLLER``)."""
        if self.client is not None and self.cfg.rendezvous.ha:
            return self.client.endpoint  # the leader this agent last reached
        return self.server.endpoint if self.server else str(self.cfg.rendezvous.controller_endpoint)

    # ---- requests ---------------------------------------------------------------------------
    def call_until(self, client: ControlClient, verb: Verb, payload: dict, done, what: str,
                   rejoin: bool = False) -> dict:
        """Retry ``verb`` until ``done(answer)`` or the rendezvous timeout; unreachable is retried.
        ``rejoin``: a 403 (this node is not a member) raises :class:`Rejoin` instead of failing."""
        deadline = time.monotonic() + self.cfg.rendezvous.rdzv_timeout_s
        last_error = "no answer"
        while time.monotonic() < deadline:
            try:
                answer = client.call(verb, payload)
                if done(answer):
                    return answer
            except ControlPlaneError as e:
                if rejoin and e.status == 403:
                    raise Rejoin() from None
                if e.status:  # an answer that refuses is final
                    raise JobFailed(str(e)) from None
                last_error = str(e)
            time.sleep(0.1)
        raise JobFailed(f"{what} timed out after {self.cfg.rendezvous.rdzv_timeout_s:.0f} s ({last_error})")

    def call(self, client: ControlClient, verb: Verb, payload: dict, fenced: bool = False) -> dict:
        """One request stamped with this node and generation. A stale-generation refusal is
        answered by catching up to the controller's generation and asking again, once; an
        unreachable controller is retried until this node's lease ends (then :class:`Fenced`)."""
        caught_up = False
        while True:
            sent = time.monotonic()
            # no request may outlast the lease: the fencing deadline holds even when packets vanish
            lease_left = self.last_ok + self.cfg.fault_tolerance.fence_after_s - sent
            try:
                answer = client.call(verb, {**payload, "node_rank": self.cfg.launch.node_rank, "generation": self.generation},
                                     timeout_s=min(10.0, max(0.2, lease_left)))
                self.last_ok = max(self.last_ok, sent)
                return answer
            except ControlPlaneError as e:
                if not e.status:
                    silent = time.monotonic() - self.last_ok
                    if silent > self.cfg.fault_tolerance.fence_after_s:
                        raise Fenced(f"no answer from the controller at {client.endpoint} for {silent:.1f} s "
                                     f"(lease {self.cfg.fault_tolerance.fence_after_s:g} s, generation {self.generation}): {e}") from None
                    time.sleep(min(0.2, self.cfg.fault_tolerance.heartbeat_interval_s))
                    continue
                if fenced and not caught_up and e.status == 409 and "generation" in e.body:
                    self.generation, caught_up = e.body["generation"], True
                    continue
                raise JobFailed(e.body.get("reason") or str(e)) from None

    def tell(self, verb: Verb, payload: dict) -> dict:
        """A fenced request with the client this node takes part with."""
        return self.call(self.client, verb, payload, fenced=True)

    def tell_stopping(self, why: str) -> None:
        try:
            ControlClient(self.endpoint(), self.token, timeout_s=2, node=self.cfg.launch.node_rank).call(
                Verb.NODE_STOPPING, {"node_rank": self.cfg.launch.node_rank, "generation": self.generation, "reason": why})
        except ControlPlaneError:
            pass  # the controller may be gone already; stopping goes on regardless

    # ---- closing ----------------------------------------------------------------------------
    def close_controller(self) -> None:
        """Stop the controller this node hosts and its store (after it, this node's relay read fails at once)."""
        if self.server:
            self.server.stop()
        if self.store:
            self.store.close()

    def close_replica(self) -> None:
        """HA: release the lease if this node's replica leads (a standby takes over at once)."""
        if self.replica is not None:
            self.replica.stop()
        if self.forming is not None:
            self.forming.close()


def local_address(host: str, port: int) -> str:
    """The address this host uses to reach ``host`` (no packet is sent: a UDP connect only routes)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return s.getsockname()[0]
    except OSError:
        return ""

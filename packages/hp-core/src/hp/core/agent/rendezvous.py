"""Joining the job: the rendezvous that gives this node its ranks (an :class:`Assignment`), and the node
services (hp.core.services) every node starts before its workers."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from hp.core.agent.link import JobFailed, Link, Rejoin
from hp.core.agent.messages import say
from hp.core.config import RunConfig
from hp.core.control_plane import ControlClient
from hp.core.protocol import NODE_INCARNATION_ENV, JobState, Verb, spare_id
from hp.core.services import NodeContext, ServiceError, ServiceHost


@dataclass
class Assignment:
    """What the rendezvous gave this node."""

    generation: int
    world_size: int
    rank_offset: int
    store_host: str
    store_port: int
    spare_ids: list[str]  # of the spares this node starts; a node that joined a running job: all its processes


def rendezvous(cfg: RunConfig, link: Link, client: ControlClient) -> Assignment:
    """Join the controller and wait for the job to form; this node's lease starts with its generation."""
    me = {"node_rank": cfg.launch.node_rank}
    forming = link.forming_store()
    join = {**me, "nproc": cfg.launch.nproc_per_node, "spares": cfg.fault_tolerance.spares, "host": socket.gethostname(),
            "address": link.address, "incarnation": os.environ.get(NODE_INCARNATION_ENV, ""),
            **({"forming_store": forming} if forming is not None else {})}
    while True:
        link.call_until(client, Verb.JOIN, join, lambda a: True, "joining the controller")
        try:
            a = link.call_until(client, Verb.RENDEZVOUS, me, lambda a: a["state"] != JobState.RENDEZVOUS,
                                "rendezvous", rejoin=cfg.rendezvous.ha)
            break
        except Rejoin:  # HA: a new leader took over during the rendezvous, which is not persisted
            say("the controller moved during the rendezvous: joining its new leader")
    if a["state"] != JobState.RUNNING:
        raise JobFailed(a.get("reason") or f"job is {a['state']}")
    link.start_lease(a["generation"])
    prefix = spare_id(cfg.launch.node_rank, 0)[:-1]  # the ids name log files and heartbeat files
    if not all(isinstance(s, str) and s.startswith(prefix) and s[len(prefix):].isdigit() for s in a["spare_ids"]):
        raise JobFailed(f"the controller named spares {a['spare_ids']!r}, not {prefix}<k>")
    return Assignment(a["generation"], a["world_size"], a["rank_offset"], a["store_host"], a["store_port"],
                      a["spare_ids"])


def start_services(cfg: RunConfig, services: ServiceHost, link: Link, client: ControlClient, a: Assignment,
                   store_backend, log_dir: str, token: str) -> None:
    """Start this node's services and wait for every node's (exchanging endpoints through the job's store)."""
    if not cfg.launch.services:
        return
    node = NodeContext(run_id=cfg.launch.run_id, node_rank=cfg.launch.node_rank, nnodes=cfg.launch.nnodes,
                       address=link.address, log_dir=log_dir, token=token)
    store = None if cfg.launch.nnodes == 1 else store_backend.connect(a.store_host, a.store_port, job=cfg.launch.run_id)

    def keep_alive() -> None:  # while waiting for the other nodes' services: stay a live node
        if link.call(client, Verb.HEARTBEAT, {})["state"] == JobState.FAILED:
            raise JobFailed("the job failed while node services were starting")

    try:
        services.start(node, store, cfg.rendezvous.rdzv_timeout_s, keep_alive)
    except ServiceError as e:
        link.tell_stopping(str(e))
        raise JobFailed(str(e)) from None
    say(f"node services started: {', '.join(cfg.launch.services)}")

"""The environment a worker or spare of this node starts with: pure, built from what the agent knows
when it starts the process (tested without starting one).

hp's contract is :class:`hp.core.worker_env.WorkerEnv`; merged under it, in this order, the transport's
defaults that the agent's own environment does not set, the node services' endpoints and the thread
counts; over it, the relay's (:mod:`hp.core.fanout`). A later source wins a key both set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hp.core.config import RunConfig
from hp.core.worker_env import WorkerEnv
from hp.core.workers import Worker


def heartbeat_file(log_dir: str, w: Worker) -> str:
    """The file this attempt of ``w`` touches while alive (one per attempt: a restart starts silent)."""
    return os.path.join(log_dir, "heartbeats", f"{w.name}.attempt{w.restarts}")


def worker_env(w: Worker, cfg: RunConfig, *, world_size: int, store_host: str, store_port: int, generation: int,
               controller: str, token: str, transport: str, store: str, log_dir: str, agent_pid: int,
               transport_defaults: Mapping[str, str] = {}, services_env: Mapping[str, str] = {},
               relay_env: Mapping[str, str] = {}, outer_env: Mapping[str, str] = {}) -> dict[str, str]:
    """``w``'s environment; ``w.heartbeat_file`` must be set (:func:`heartbeat_file`). A transport default
    the agent's own environment (``outer_env``) sets is left to it: the worker inherits that value."""
    contract = WorkerEnv(
        generation=generation, world_size=world_size, local_rank=w.local_rank,  # its device, a spare's too:
        local_world_size=cfg.launch.nproc_per_node, node_rank=cfg.launch.node_rank,     # it keeps it when promoted
        nnodes=cfg.launch.nnodes, store_host=store_host, store_port=store_port, run_id=cfg.launch.run_id, token=token,
        rank=w.rank if w.spare_id is None else -1, spare_id=w.spare_id, holder=w.holder, controller=controller,
        controller_ha=cfg.rendezvous.ha, transport=transport, store=store, log_dir=log_dir, heartbeat_file=w.heartbeat_file,
        agent_pid=agent_pid, max_restarts=cfg.fault_tolerance.max_restarts,
        scaling_policy=None if cfg.elastic.scaling_policy is None else os.path.abspath(cfg.elastic.scaling_policy),
    )
    env = {k: v for k, v in transport_defaults.items() if k not in outer_env}
    env.update(services_env)
    env.update(cfg.worker_thread_env())
    env.update(contract.to_env())
    env.update(relay_env)
    return env

"""The environment ``hp run``'s agent gives each worker and spare: one typed contract, written and read only here.

The agent builds a :class:`WorkerEnv` and starts the process with :meth:`WorkerEnv.to_env`; the runtime
(``hp.checkpointless``, :class:`hp.core.worker.WorkerContext`) reads it back with :meth:`WorkerEnv.from_env`.
The names torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_*``, …) carry
their torchrun meaning, so a script written for torchrun reads what it expects; hp's own keys start ``HP_``.
A spare has no rank until the controller promotes it: its ``RANK`` is unset and :attr:`WorkerEnv.rank` is -1.

Not here, because each is its own component's contract: the transport's defaults
(:meth:`hp.core.transport.Transport.env_defaults`), the node services' endpoints (``services.worker_env``),
the relay's (:mod:`hp.core.fanout`), the thread counts (``RunConfig.worker_thread_env``), the fault plan
(``HP_FAULTS``) and the data cache (``HP_DATA_CACHE_DIR``). Stdlib only: read before torch is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from hp.core.errors import UsageError

TOKEN_ENV = "HP_JOB_TOKEN"  # the job token: signs every control request and seals every store value
NODE_INCARNATION_ENV = "HP_NODE_INCARNATION"  # set on an agent: which start of its node this is (fencing)
SCALING_POLICY_ENV = "HP_SCALING_POLICY"  # a user's scaling policy file (hp.elastic), absolute path
AGENT_PID_ENV = "HP_AGENT_PID"  # the agent's pid: a worker whose agent is gone leaves (orphan check)

WORKER = "worker"
SPARE = "spare"

# what a process started by ``hp run`` cannot do without; a spare has no RANK
_REQUIRED = ("WORLD_SIZE", "HP_GENERATION", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class WorkerEnv:
    """What one worker (or hot spare) of one node learns from its agent at start."""

    generation: int  # the generation the agent knew when it started the process (the runtime may find newer)
    world_size: int  # the job's ranks at start (a spare reads its world from the plan that promotes it)
    local_rank: int  # its device on the node; a spare's too, which it keeps when promoted
    local_world_size: int  # workers per node
    node_rank: int
    nnodes: int
    store_host: str  # the job's coordination store (hosted by the controller): every rank is a client
    store_port: int
    run_id: str
    token: str = field(repr=False)  # never printed
    rank: int = -1  # -1 for a spare
    spare_id: str | None = None  # set for a spare only
    holder: str = ""  # the name the controller fences this process by (protocol.worker_holder/spare_holder)
    controller: str = ""  # the control plane's endpoint (the leader this agent last reached, with HA)
    controller_ha: bool = False  # follow the controller when another replica leads
    transport: str = "gloo"  # the transport plugin's name
    store: str = "tcp"  # the store plugin's name
    log_dir: str | None = None  # the node's log folder (events, offers, heartbeats)
    heartbeat_file: str | None = None  # the file this process touches while alive
    agent_pid: int | None = None
    max_restarts: int = 0
    scaling_policy: str | None = None  # absolute path of the job's scaling policy file, if any

    @property
    def role(self) -> str:
        return SPARE if self.spare_id is not None else WORKER

    def to_env(self) -> dict[str, str]:
        """The environment variables, torchrun's names where torchrun has one."""
        env = {
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank), "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_WORLD_SIZE": str(self.world_size), "ROLE_NAME": "default",
            "MASTER_ADDR": self.store_host, "MASTER_PORT": str(self.store_port),
            # the store is hosted by the controller: every rank, rank 0 included, is a client
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "HP_ROLE": self.role,
            "HP_GENERATION": str(self.generation),
            "HP_CONTROLLER": self.controller,
            TOKEN_ENV: self.token,
            "HP_TRANSPORT": self.transport,
            "HP_STORE": self.store,
            "HP_STORE_JOB": self.run_id,  # the job's keys in a store many jobs share (etcd)
            "HP_CONTROLLER_HA": "1" if self.controller_ha else "",
            "HP_NODE_RANK": str(self.node_rank),
            "HP_RUN_ID": self.run_id,
            "HP_HOLDER": self.holder,
        }
        if self.spare_id is None:
            env.update({"RANK": str(self.rank), "ROLE_RANK": str(self.rank)})
        else:  # a spare learns its rank from the controller when it is promoted
            env["HP_SPARE_ID"] = self.spare_id
        optional = {"HP_LOG_DIR": self.log_dir, "HP_HEARTBEAT_FILE": self.heartbeat_file,
                    AGENT_PID_ENV: None if self.agent_pid is None else str(self.agent_pid),
                    SCALING_POLICY_ENV: self.scaling_policy}
        env.update({k: v for k, v in optional.items() if v is not None})
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WorkerEnv:
        """Read it back; a process not started by ``hp run`` gets a one-line :class:`UsageError`."""
        spare = env.get("HP_ROLE", WORKER) == SPARE
        missing = [k for k in _REQUIRED + (() if spare else ("RANK",)) if k not in env]
        if missing:
            raise UsageError(f"not started by `hp run` (missing {', '.join(missing)})")
        try:
            return cls(
                generation=int(env["HP_GENERATION"]), world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")), local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
                node_rank=int(env.get("HP_NODE_RANK", env.get("GROUP_RANK", "0"))),
                nnodes=int(env.get("GROUP_WORLD_SIZE", "1")),
                store_host=env["MASTER_ADDR"], store_port=int(env["MASTER_PORT"]),
                run_id=env.get("HP_RUN_ID", env.get("TORCHELASTIC_RUN_ID", "")), token=env.get(TOKEN_ENV, ""),
                rank=-1 if spare else int(env["RANK"]), spare_id=env.get("HP_SPARE_ID", "") if spare else None,
                holder=env.get("HP_HOLDER", ""), controller=env.get("HP_CONTROLLER", ""),
                controller_ha=bool(env.get("HP_CONTROLLER_HA")), transport=env.get("HP_TRANSPORT", "gloo"),
                store=env.get("HP_STORE", "tcp"), log_dir=env.get("HP_LOG_DIR") or None,
                heartbeat_file=env.get("HP_HEARTBEAT_FILE") or None,
                agent_pid=int(env[AGENT_PID_ENV]) if env.get(AGENT_PID_ENV, "").isdigit() else None,
                max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
                scaling_policy=env.get(SCALING_POLICY_ENV) or None,
            )
        except ValueError as e:
            raise UsageError(f"the worker environment `hp run` set is malformed: {e}") from None

"""What a training process launched by ``hp run`` knows about itself, and its process group."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from hp.core.errors import UsageError


@dataclass(frozen=True)
class WorkerContext:
    """Identity of this worker in the current generation, read from the environment ``hp run`` sets."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    generation: int
    run_id: str
    transport: str
    store: str
    store_host: str
    store_port: int
    controller: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WorkerContext:
        missing = [k for k in ("RANK", "WORLD_SIZE", "HP_GENERATION", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise UsageError(f"not started by `hp run` (missing {', '.join(missing)})")
        return cls(
            rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]), local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            node_rank=int(env.get("HP_NODE_RANK", "0")), generation=int(env["HP_GENERATION"]),
            run_id=env.get("HP_RUN_ID", ""), transport=env.get("HP_TRANSPORT", "gloo"),
            store=env.get("HP_STORE", "tcp"),
            store_host=env["MASTER_ADDR"], store_port=int(env["MASTER_PORT"]),
            controller=env.get("HP_CONTROLLER", ""),
        )

    @property
    def device(self) -> str:
        from hp.core.plugins import get_backend

        return get_backend("transport", self.transport).device_for(self.local_rank)

    def init_process_group(self, timeout: timedelta = timedelta(minutes=10)) -> None:
        """Join this generation's process group: the job's store, keys prefixed by generation,
        so that processes of an older generation can never meet this one."""
        from hp.core.plugins import get_backend

        store = get_backend("store", self.store).connect(self.store_host, self.store_port, timeout)
        get_backend("transport", self.transport).init_process_group(
            store, self.rank, self.world_size, self.generation, timeout)

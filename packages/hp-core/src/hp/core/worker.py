"""What a training process launched by ``hp run`` knows about itself, and its process group."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from hp.core.errors import UsageError
from hp.core.worker_env import WorkerEnv


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
        w = WorkerEnv.from_env(env)
        if w.rank < 0:
            raise UsageError("a hot spare has no rank until it is promoted: WorkerContext is for workers")
        return cls(rank=w.rank, local_rank=w.local_rank, world_size=w.world_size,
                   local_world_size=w.local_world_size, node_rank=w.node_rank, generation=w.generation,
                   run_id=w.run_id, transport=w.transport, store=w.store, store_host=w.store_host,
                   store_port=w.store_port, controller=w.controller)

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

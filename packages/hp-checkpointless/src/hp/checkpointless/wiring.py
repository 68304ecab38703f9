"""What a process started by ``hp run`` is wired to, built once from its environment.

The environment is read in one place, as a :class:`hp.core.worker_env.WorkerEnv` (:func:`read_worker_env`);
from it come the job's store, the transport, the event log, the fault plan, this rank's recovery machine
and process group link, the :class:`~hp.checkpointless.formation.Formation` that joins generations, the
device mesh (when the job asks for one) and the watch thread. The fault plan and the node's relay read
their own keys (``HP_FAULTS``, the relay's): each is its component's contract, not the worker's.
The parts are public attributes: the step loop, the hooks and the recovery path are given this object
and use them, none of them builds its own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from hp.checkpointless import membership
from hp.checkpointless.events import EventLog
from hp.checkpointless.faults import FaultPlan
from hp.checkpointless.formation import Formation
from hp.checkpointless.group import GroupLink
from hp.checkpointless.mesh import GenerationMesh, MeshLayout
from hp.checkpointless.recovery import RankState, RecoveryMachine
from hp.checkpointless.registry import warm_optimizer_imports
from hp.core.control_plane import ControlClient
from hp.core.errors import UsageError
from hp.core.fanout import Mirror
from hp.core.plugins import get_backend
from hp.core.protocol import Event, Plan
from hp.core.signed_values import Refusals, sealing
from hp.core.worker_env import TOKEN_ENV, WorkerEnv

EXIT_ORPHANED = 76  # the agent died: no one supervises this process


def read_worker_env(env: Mapping[str, str]) -> WorkerEnv:
    """The worker's environment, or a one-line :class:`UsageError` for a process ``hp run`` did not start."""
    if "HP_GENERATION" not in env:
        raise UsageError("hp.checkpointless needs `hp run` (HP_GENERATION is not set)")
    worker = WorkerEnv.from_env(env)
    if not worker.token:  # every value read from the store is sealed with it (hp.core.signed_values)
        raise UsageError(f"hp.checkpointless needs the job token in {TOKEN_ENV} (`hp run` sets it)")
    return worker


class Wiring:
    """One process's connections to the job; ``on_release``: called when its failed group is torn down,
    so that whatever else holds the group (a sharded optimizer) lets go of it first (group.py)."""

    def __init__(self, worker: WorkerEnv, env: Mapping[str, str], pg_timeout: timedelta,
                 on_release: Callable[[], None]) -> None:
        self.worker = worker
        self.transport = get_backend("transport", worker.transport)
        self.store = membership.connect_store(worker.store_host, worker.store_port, worker.store)
        self.channel = Mirror.from_env(env)  # the node's relay of the membership (hp.core.fanout); None without
        log_dir = worker.log_dir
        self.offers = os.path.join(log_dir, "offers") if log_dir else None  # the node's (hp.checkpointless.premap)
        self.events = EventLog(os.path.join(log_dir, "events") if log_dir else None,
                               f"rank{worker.rank}" if worker.spare_id is None else f"spare-{worker.spare_id}")
        self.faults = FaultPlan.from_env(lambda key: self.store.add(key, 1) == 1, env)
        self.publish = sealing(self.store.set, worker.token)
        self.token = worker.token  # also seals a spare's offer of its buffer (hp.checkpointless.premap)
        self.refusals = Refusals(self.refused)
        self.machine = RecoveryMachine()
        self.link = GroupLink(self.transport, self.store, self.machine, pg_timeout, self.events, on_release)
        node = str(worker.node_rank)
        self.formation = Formation(
            rank=worker.rank, spare_id=worker.spare_id, node_rank=worker.node_rank, holder=worker.holder,
            local_rank=worker.local_rank, store=self.store, token=worker.token,
            controller=ControlClient(worker.controller, worker.token, node=node, follow=self._follow()),
            machine=self.machine, link=self.link, events=self.events, fire=self.phase, refusals=self.refusals,
            channel=self.channel)
        self.watch: membership.Watch | None = None  # started by watch_generations, once its listener exists
        self.mesh_args: tuple[int | None, int | None] = (None, None)  # ctx.device_mesh()'s, once called

    @property
    def world_size(self) -> int:
        """The current group's, else the job's at start (a spare before it has a rank)."""
        return self.link.world_size or self.worker.world_size

    @property
    def device(self) -> torch.device:
        return torch.device(self.transport.device_for(self.worker.local_rank))

    def watch_generations(self, on_generation: Callable[[Plan], None]) -> None:
        """Start the watch thread: each newly published plan goes to ``on_generation`` (the interrupt)."""
        w = self.worker
        self.watch = membership.Watch(lambda: membership.connect_store(w.store_host, w.store_port, w.store),
                                      w.heartbeat_file, on_generation, on_orphaned=self.orphaned, token=w.token,
                                      refusals=self.refusals, channel=self.channel, agent_pid=w.agent_pid).start()

    def phase(self, step: int, phase: str) -> None:
        """A fault phase of ``step`` is reached: the fault plan fires whatever it holds for it here."""
        rank = self.formation.rank
        self.faults.fire(int(step), phase, rank, lambda f: self.events.record(
            Event.FAULT_INJECTED, kind=f.kind, phase=phase, step=int(step), rank=rank))

    def device_mesh(self, replicate: int | None, shard: int | None, before: Callable[[str], None]) -> Any:
        """The job's ``DeviceMesh`` (see :meth:`hp.checkpointless.runtime.Context.device_mesh`): built and
        its first generation formed on the first call; ``before`` runs ahead of each of its collectives."""
        mesh = self.link.mesh
        if mesh is not None:
            if self.mesh_args != (replicate, shard):
                raise UsageError(f"ctx.device_mesh() was called with replicate={self.mesh_args[0]}, "
                                 f"shard={self.mesh_args[1]}, now with replicate={replicate}, shard={shard}")
            return mesh.device_mesh
        formation, start_world = self.formation, self.worker.world_size
        MeshLayout.of(start_world, replicate, shard)  # bad arguments: one line, before a spare waits
        if formation.rank < 0:
            warm_optimizer_imports()  # a spare builds its model and optimizer once promoted: not the imports
        rank = formation.rank if formation.rank >= 0 else formation.assign(None)
        # a spare's mesh is of the generation it joins (an elastic job's size may have changed since it started)
        layout = MeshLayout.of(formation.assigned_world() or start_world, replicate, shard)
        device_type = torch.device(self.transport.device_for(0)).type
        self.mesh_args = (replicate, shard)
        self.link.mesh = GenerationMesh(layout, rank, device_type, before=before)
        # torch's mesh needs a default group to shard on: the first generation forms now, and settles
        # (agreement, hydration) in ctx.steps()
        formation.enter_first(self.worker.generation)
        return self.link.mesh.device_mesh

    def _follow(self) -> Callable | None:
        """HA controller (``hp run --store etcd``): where reports go when the controller moves to
        another replica (:class:`hp.core.leader.LeaderResolver` on this process's store); else None."""
        if not self.worker.controller_ha:
            return None
        from hp.core.leader import LeaderResolver

        return LeaderResolver(self.store, self.worker.token).wait_for_other

    def refused(self, key: str, message: str) -> None:
        """A store value not sealed for its key was read (any thread): ignored, said at most every 30 s per key."""
        self.events.record(Event.STORE_VALUE_REFUSED, rank=self.formation.rank, key=key, error=message[:300])
        print(f"hp: rank {self.formation.rank}: warning: {message}; ignored", file=sys.stderr, flush=True)

    def orphaned(self) -> None:
        """The agent that started this process is gone (SIGKILLed with its node's controller, say): seen
        by the watch thread, or by the main thread when a failure (a peer that left for this reason, the
        store gone with the agent) finds it gone first. Nobody can fence or replace this rank any more:
        leave at once."""
        self.events.record(Event.ORPHANED, rank=self.formation.rank, generation=self.machine.generation)
        print(f"hp: rank {self.formation.rank}: the agent that started this process died; exiting",
              file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)

    def leave_if_orphaned(self) -> None:
        """Main thread, on a failure: if the agent is gone, that is why; leave as the watch thread would."""
        if self.watch is not None and self.watch.orphaned():
            self.orphaned()

    def close(self) -> None:
        """Leave the job: stop the watch thread, destroy the process group. Idempotent."""
        if self.machine.state is not RankState.CLOSED:
            self.machine.to(RankState.CLOSED)
        if self.watch is not None:
            self.watch.stop()
        if self.channel is not None:
            self.channel.close()
        self.link.close()
        self.events.close()

"""This node's processes: the workers holding a rank and the hot spares waiting for one, each on its own
device slot (``LOCAL_RANK``, hp.core.devices), and the moves between the two lists the controller decides.

The pool starts a process only inside the agent's signal window (``starting``, hp.core.agent.signals) and
with the environment ``env_for`` builds (hp.core.agent.env); it tells the controller of a spare it adds
through ``tell``. It decides nothing itself.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

from torch.distributed.elastic.multiprocessing import Std

from hp.core import forkserver
from hp.core.agent.env import heartbeat_file
from hp.core.agent.messages import say
from hp.core.agent.rendezvous import Assignment
from hp.core.config import RunConfig
from hp.core.devices import DeviceSlots
from hp.core.protocol import Verb, spare_holder, spare_id, worker_holder
from hp.core.workers import Worker, python_command


class Pool:
    def __init__(self, config: RunConfig, log_dir: str, env_for: Callable[[Worker], dict[str, str]],
                 starting: Callable[[], AbstractContextManager], tell: Callable[[Verb, dict], dict]) -> None:
        self.cfg = config
        self.log_dir = log_dir
        self.env_for = env_for
        self.starting = starting
        self.tell = tell
        self.workers: list[Worker] = []  # processes holding a rank
        self.spares: list[Worker] = []  # started, waiting to be given a rank
        self.devices = DeviceSlots(0)  # sized by start()
        self.command: list[str] = []
        self.next_spare = config.fault_tolerance.spares  # index of the next replacement spare's id

    def processes(self) -> list[Worker]:
        return self.workers + self.spares

    # ---- starting -----------------------------------------------------------------------
    def start(self, a: Assignment, kind: type[Worker]) -> None:
        """This node's workers (none for a node that joins a running job) and the spares the controller named."""
        command = self.command = python_command(self.cfg.launch.entrypoint, self.cfg.launch.args, self.cfg.launch.module)
        os.makedirs(os.path.join(self.log_dir, "heartbeats"), exist_ok=True)
        tee = Std(self.cfg.logging.tee)
        # one device slot (LOCAL_RANK) per process, spares included (hp.core.devices)
        self.devices = DeviceSlots(self.cfg.launch.nproc_per_node + len(a.spare_ids))
        if a.rank_offset >= 0:
            for _ in range(self.cfg.launch.nproc_per_node):
                local_rank = self.devices.take()  # 0, 1, ... in order
                rank = a.rank_offset + local_rank
                self.workers.append(kind(rank, local_rank, command, self.log_dir, tee, holder=worker_holder(rank, 0)))
        else:
            say(f"node {self.cfg.launch.node_rank} joins a running job: its {self.cfg.launch.nproc_per_node} process(es) "
                f"start as spares that the job grows into")
        for sid in a.spare_ids:
            self.spares.append(kind(-1, self.devices.take(), command, self.log_dir, tee, spare_id=sid,
                                    holder=spare_holder(sid)))
        self.next_spare = 1 + max((int(s.rpartition("s")[2]) for s in a.spare_ids), default=self.cfg.fault_tolerance.spares - 1)
        for w in self.workers + self.spares:
            with self.starting():
                self._launch(w)

    def _launch(self, w: Worker) -> None:
        w.heartbeat_file = heartbeat_file(self.log_dir, w)
        w.start(self.env_for(w))

    def restart(self, w: Worker, holder: str, rank: int) -> None:
        """A new process for the rank ``w`` held (a spare given a rank before this agent heard of it too)."""
        w.restarts, w.holder, w.rank = w.restarts + 1, holder, rank
        if w not in self.workers:
            self.workers.append(w)
        with self.starting():
            self._launch(w)

    def add_spare(self, joiner: bool = False) -> None:
        """Replace a promoted spare (or, ``joiner``, a rank the job shrank without: the job grows back into
        it once it is ready): a new process with a never-used id, registered as free. It starts while the
        job trains, so it is forked with torch already imported (hp.core.forkserver)."""
        sid = spare_id(self.cfg.launch.node_rank, self.next_spare)
        self.next_spare += 1
        w = forkserver.ForkedWorker(-1, self.devices.take(), self.command, self.log_dir, Std(self.cfg.logging.tee),
                                    spare_id=sid, holder=spare_holder(sid))
        with self.starting():
            self._launch(w)
            self.spares.append(w)
        self.tell(Verb.SPARE_ADDED, {"spare": sid, "joiner": joiner})
        say(f"started spare {sid} (pid {w.pid}, forked with torch imported) to replace the "
            f"{'dead rank' if joiner else 'promoted one'}")

    # ---- moves --------------------------------------------------------------------------
    def promote(self, promotion: dict) -> None:
        spare = next((s for s in self.spares if s.spare_id == promotion["spare"]), None)
        if spare is None:
            return  # it died meanwhile; its own exit is reported as a worker failure of that rank
        self.spares.remove(spare)
        spare.rank = promotion["rank"]
        self.workers.append(spare)
        say(f"spare {spare.spare_id} (pid {spare.pid}) now holds rank {spare.rank} "
            f"(generation {promotion['generation']})")
        if self.cfg.fault_tolerance.replenish_spares:
            self.add_spare()

    def retire(self, w: Worker) -> None:
        """``w`` holds no rank here any more: its device slot is free for the process that replaces it."""
        if w in self.workers:
            self.workers.remove(w)
        self.devices.release(w.local_rank)

    def spare_exited(self, w: Worker) -> None:
        """A spare ended by itself; ``w.exit.ok``: only a spare given a rank does (this agent has not heard yet)."""
        self.spares.remove(w)
        if w.exit.ok:
            self.workers.append(w)

    def renumber(self, ranks: dict[str, int]) -> None:
        """The controller's ranks of this node's processes, by holder id (scale events renumber them)."""
        for w in self.workers:
            w.rank = ranks.get(w.holder, w.rank)

    def leave(self, stopping: Iterable[str]) -> None:
        """Elastic leave: the spares the controller lets go (``stopping``) stop; one promoted since the
        last heartbeat holds a rank that leaves at the boundary."""
        stopping = set(stopping)
        for spare in list(self.spares):
            if spare.spare_id in stopping:
                spare.stop(signal.SIGTERM)
            else:
                self.spares.remove(spare)
                self.workers.append(spare)

    def drop_spares(self) -> None:
        for spare in self.spares:
            spare.stop(signal.SIGTERM)  # nothing left on this node for a spare to replace
        self.spares.clear()

    # ---- stopping -----------------------------------------------------------------------
    def workers_exited(self) -> bool:
        return all(w.poll() is not None for w in self.workers if w.running)

    def kill(self) -> None:
        """SIGKILL every running process now: they must not commit another step."""
        for w in self.workers + self.spares:
            if w.running:
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self, sig: signal.Signals) -> None:
        for w in self.workers + self.spares:
            w.stop(sig)

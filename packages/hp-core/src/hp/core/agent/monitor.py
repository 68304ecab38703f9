"""The agent's loop while its workers run: it polls them, reports a dead one to the controller and carries
out the decision (restart it here, promote a spare, go on with fewer ranks, stop), heartbeats, and follows
what each heartbeat answers (generation, ranks, promotions, lost nodes, the job's end).

A dead worker is *reported*; the controller decides and healthy workers keep running.
"""

from __future__ import annotations

import time

from hp.core.agent.cuts import Cuts
from hp.core.agent.departure import Departure
from hp.core.agent.link import JobFailed, Link
from hp.core.agent.messages import say
from hp.core.agent.pool import Pool
from hp.core.config import RunConfig
from hp.core.control_plane import ControlClient
from hp.core.errors import ControlPlaneError
from hp.core.exits import CleanExits, Verdict
from hp.core.plugins import get_backend
from hp.core.protocol import FailureAction, JobState, Verb
from hp.core.services import ServiceHost
from hp.core.workers import Worker


class Monitor:
    def __init__(self, config: RunConfig, link: Link, pool: Pool, departure: Departure, services: ServiceHost,
                 cuts: Cuts, elastic: bool) -> None:
        self.cfg = config
        self.link = link
        self.pool = pool
        self.departure = departure
        self.services = services
        self.cuts = cuts
        self.elastic = elastic  # a scaling policy runs the job: a rank may be scaled out
        self.exits = CleanExits(elastic=elastic)  # finished or scaled out (hp.core.exits)
        self.capacity: int | None = None  # the last capacity the scheduler gave (elastic)

    def run(self, client: ControlClient) -> int:
        """Until the job ends for this node; returns the exit code for ``hp run``."""
        self.link.client = client
        next_beat = 0.0
        while True:
            for w in list(self.pool.workers):
                if w.running and not w.hung and self.cfg.fault_tolerance.hang_timeout_s and w.silent_for() > self.cfg.fault_tolerance.hang_timeout_s:
                    say(f"rank {w.rank} (pid {w.pid}) hung: no heartbeat for {w.silent_for():.1f} s; killing it")
                    w.kill_hung()
                if w.running and (status := w.poll()) is not None:
                    if not status.ok:
                        self._on_failure(client, w)
                    elif self.exits.exited(w.holder, time.monotonic()):
                        next_beat = 0.0  # finished or scaled out: the membership read after the exit tells
            for w in list(self.pool.spares):
                if not w.running or (status := w.poll()) is None:
                    continue
                self.pool.spare_exited(w)
                if status.ok:  # only a spare given a rank ends by itself (this agent has not heard yet)
                    if self.exits.exited(w.holder, time.monotonic()):
                        next_beat = 0.0
                    continue
                w.finish()
                self.pool.retire(w)
                say(f"spare {w.spare_id} (pid {w.pid}) exited: {w.exit.describe()}")
                answer = self.link.call(client, Verb.SPARE_FAILED, {"spare": w.spare_id}, fenced=True)
                if "action" in answer:  # promoted before this agent heard of it: a rank died
                    w.rank = answer.get("rank", w.rank)
                    self._act(w, answer)
            if time.monotonic() >= next_beat:
                asked = time.monotonic()
                next_beat = asked + self.cfg.fault_tolerance.heartbeat_interval_s
                beat = self.link.call(client, Verb.HEARTBEAT, {})
                for line in self.services.check():
                    say(line)
                self.link.catch_up(beat["generation"])
                self._renumber(beat.get("ranks", {}), asked)
                for promotion in beat.get("promotions", []):
                    self.pool.promote(promotion)
                self.cuts.cut_lost(beat.get("lost", []))
                self._follow_capacity(client)
                if beat["state"] == JobState.FAILED:
                    raise JobFailed(beat["reason"])
                if beat["state"] == JobState.PREEMPTED:
                    return self.departure.preempted(client, time.monotonic() + self.cfg.elastic.grace_period_s)
                if beat["state"] == JobState.SUCCEEDED:
                    return 0
            self._scaled_out()
            workers = self.pool.workers
            if not self.departure.done_reported and workers and all(
                    w.exit and w.exit.ok and self.exits.verdict(w.holder) is Verdict.FINISHED for w in workers):
                self.pool.drop_spares()
                done = self.departure.report_done(client)
                if done["state"] == JobState.PREEMPTED:  # they saved and exited before a heartbeat told us
                    return self.departure.preempted(client, time.monotonic() + self.cfg.elastic.grace_period_s)
                if not self.cfg.hosts_controller:
                    say(f"node {self.cfg.launch.node_rank}: all {len(workers)} workers succeeded")
                    return 0
                next_beat = 0.0
            time.sleep(self.cfg.fault_tolerance.monitor_interval_s)

    def _on_failure(self, client: ControlClient, w: Worker) -> None:
        st = w.exit
        say(f"rank {w.rank} (pid {st.pid}) failed: {st.describe()}; reporting to the controller")
        decision = self.link.call(client, Verb.WORKER_FAILED, {
            "rank": w.rank, "holder": w.holder, "pid": st.pid, "exitcode": st.exitcode,
            "signal": st.signal, "message": st.message,
        }, fenced=True)
        w.finish()
        self._act(w, decision)

    def _act(self, w: Worker, decision: dict) -> None:
        """Carry out the controller's decision about the dead process ``w`` that held a rank."""
        action = decision["action"]
        if action == FailureAction.STOP:
            raise JobFailed(decision["reason"])
        self.link.catch_up(decision["generation"])
        if action == FailureAction.RESTART:
            self.pool.restart(w, decision["holder"], decision["rank"])
            say(f"restarted rank {w.rank} as pid {w.pid} (generation {self.link.generation}, restart {w.restarts})")
            return
        self.pool.retire(w)  # the rank now lives in a spare process, here or on another node
        if action == FailureAction.SHRINK:
            say(f"rank {w.rank}: no spare left; the job goes on with {decision['world_size']} ranks "
                f"(generation {self.link.generation}); a new process takes the freed slot and joins when ready")
            self.pool.add_spare(joiner=True)
        elif action == FailureAction.PROMOTE_SPARE:
            self.pool.promote(decision)
        else:
            say(f"rank {w.rank} moved to a spare on node {decision['node']} (generation {self.link.generation})")

    def _follow_capacity(self, client: ControlClient) -> None:
        """Elastic, on the node hosting the controller: the scheduler's capacity, when it changed, becomes
        the job's (the controller shrinks or grows at a step boundary)."""
        if not self.link.hosts_controller or self.cfg.elastic.capacity_file is None:
            return
        replicas = get_backend("scheduler", self.cfg.elastic.scheduler).capacity(self.cfg.elastic.capacity_file).replicas
        if replicas is None or replicas == self.capacity:
            return
        self.capacity = replicas
        try:
            answer = client.call(Verb.SCALE, {"replicas": replicas})
            say(f"capacity {replicas}: the job runs {answer['world_size']} ranks (generation {answer['generation']})")
        except ControlPlaneError as e:
            say(f"capacity {replicas}: {e}")

    def _renumber(self, ranks: dict[str, int], asked: float) -> None:
        """The controller's ranks of this node's processes, by holder id (scale events renumber them), in
        answer to a heartbeat sent at ``asked``."""
        self.exits.heard(set(ranks), asked)
        self.pool.renumber(ranks)

    def _scaled_out(self) -> None:
        """Elastic: a worker that exited 0 holding no rank any more was scaled out (``hp scale``, capacity):
        its slot gets a new process that waits as a joiner, so the job can grow back into it."""
        if not self.elastic:
            return
        for w in [w for w in self.pool.workers
                  if w.exit and w.exit.ok and self.exits.verdict(w.holder) is Verdict.SCALED_OUT]:
            self.pool.retire(w)
            say(f"{w.holder} left the job (scaled out); a new process keeps its slot for when the job grows")
            self.pool.add_spare(joiner=True)

"""The per-node agent behind ``hp run``.

It joins the job through the controller (hosting it on node 0 unless the controller is external),
spawns this node's workers, watches them and heartbeats. A dead worker is *reported*; the
controller decides (restart that worker only, or stop the job) and healthy workers keep running.

Node loss: an agent that gets no answer from the controller for ``RunConfig.fence_after_s`` (two
heartbeats less than the controller's timeout) *fences itself*: it SIGKILLs its workers and spares
and exits 1, so that no rank of a cut-off node keeps training in a generation the job has left.
The controller gives the ranks of a silent node to spares on the other nodes; their agents cut
every TCP connection to the lost node's address (``ss -K``, where permitted), which releases
survivors blocked in a collective with it now rather than at the process group's timeout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.api import SignalException

from hp.core import auth, fork_context, forkserver, health
from hp.core.config import RunConfig
from hp.core.control_plane import ControlClient, ControlServer
from hp.core.devices import DeviceSlots
from hp.core.controller import Controller, ControllerConfig
from hp.core.errors import ControlPlaneError, HpError, UsageError
from hp.core.exits import CleanExits, Verdict
from hp.core.fanout import RELAY_WAIT_S, Relay
from hp.core.plugins import get_backend, load_scaler
from hp.core.protocol import AGENT_PID_ENV, EXIT_PREEMPTED, NODE_INCARNATION_ENV, SCALING_POLICY_ENV, FailureAction, JobState, Verb, spare_holder, spare_id, worker_holder
from hp.core.rescale import ElasticController
from hp.core.scaling import Scaler
from hp.core.services import NodeContext, ServiceError, ServiceHost
from hp.core.signed_values import sealing
from hp.core.store import StoreServer
from hp.core.workers import Worker, python_command


def say(message: str) -> None:
    print(f"hp run: {message}", file=sys.stderr, flush=True)


@dataclass
class Assignment:
    """What the rendezvous gave this node."""

    generation: int
    world_size: int
    rank_offset: int
    store_host: str
    store_port: int
    spare_ids: list[str]  # of the spares this node starts; a node that joined a running job: all its processes


class JobFailed(HpError):
    """The controller stopped the job; the message says which rank failed and why."""


class _Rejoin(Exception):
    """HA: the controller that answered does not know this node (a new leader took over a rendezvous)."""


class Fenced(HpError):
    """This node lost the controller for longer than its lease: it must stop its workers."""


_deferred: list[int] = []  # signals that arrived while a worker was being started (see _starting)
_defer = False


def _raise_signal(signum: int, frame: object) -> None:
    if _defer:
        _deferred.append(signum)
        return
    raise SignalException(f"received {signal.Signals(signum).name}", sigval=signal.Signals(signum))


@contextlib.contextmanager
def _starting() -> Iterator[None]:
    """Hold SIGTERM/SIGINT while a worker process starts: raised between its spawn and the moment the
    agent records it, the signal would leave a process nobody stops (seen: an orphaned worker)."""
    global _defer
    _defer = True
    try:
        yield
    finally:
        _defer = False
        if _deferred:
            signum = _deferred[0]
            _deferred.clear()
            _raise_signal(signum, None)


class Agent:
    def __init__(self, config: RunConfig, token: str, scaler: Scaler | None = None) -> None:
        config.validate()
        self.cfg = config
        self.token = token
        self.transport = get_backend("transport", config.transport)
        self.transport.check_available()
        health.min_free_mb(os.environ)  # a bad health-check setting: one line now, not in a recovery
        self.store_backend = get_backend("store", config.store)
        self.services = ServiceHost(config.services)
        if scaler is None and config.scaling_policy is not None:  # a bad policy: one line, before anything starts
            scaler = load_scaler(config.scaling_policy)
        self.scaler = scaler
        self.log_dir = config.log_dir or tempfile.mkdtemp(prefix=f"hp_{config.run_id}_")
        try:
            os.makedirs(self.log_dir, exist_ok=True)
        except OSError as e:  # under /proc, a file in the way, no permission: one line, nothing started
            raise UsageError(f"--log-dir {self.log_dir}: {e.strerror or e}") from None
        self.generation = 0
        self.workers: list[Worker] = []  # processes holding a rank
        self.spares: list[Worker] = []  # started, waiting to be given a rank
        self._server: ControlServer | None = None
        self._store: StoreServer | None = None
        self._replica = None  # HA: this node's hp.core.leader.ControllerReplica
        self._forming: StoreServer | None = None  # HA: the TCPStore this node hosts for forming process groups
        self._relay: Relay | None = None  # forwards the membership to this node's workers (hp.core.fanout)
        self._done_reported = False
        self._last_ok = time.monotonic()  # send time of the last request the controller answered
        self._address = ""  # this node's address as the controller sees it
        self._cut: set[str] = set()  # lost nodes' addresses whose connections were cut
        self._next_spare = config.spares  # index of the next replacement spare's id
        self._client: ControlClient | None = None
        self._capacity: int | None = None  # the last capacity the scheduler gave (elastic)
        self._exits = CleanExits(elastic=self.scaler is not None)  # finished or scaled out (hp.core.exits)

    # ---- lifecycle ----------------------------------------------------------------------
    def run(self) -> int:
        """Run this node's part of the job; returns the exit code for ``hp run``."""
        previous = {s: signal.signal(s, _raise_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        forked = self.cfg.start_method == "forkserver"
        try:
            if forked:  # every worker is forked from it: torch is imported once, before this node joins (hp run
                fork_context.warm(self.cfg.worker_thread_env(), wait=True)  # started it: hp.core.commands)
            client = self._connect()
            assignment = self._rendezvous(client)
            self._start_services(client, assignment)
            if self.cfg.node_relay:
                # connecting is bounded like a read (RELAY_WAIT_S): torch retries a refused connect in C++
                self._relay = Relay(lambda: self.store_backend.connect(assignment.store_host, assignment.store_port,
                                                                       timedelta(seconds=RELAY_WAIT_S),
                                                                       job=self.cfg.run_id),
                                    self.token, self.cfg.node_rank, assignment.generation, log=say).start()
            self._start_workers(assignment, forkserver.ForkedWorker if forked else Worker)
            if not forked and ((self.cfg.replenish_spares and self.cfg.spares) or self.cfg.scaling_policy is not None):
                # replacements (and, elastic, the new process of a rank the job shrank without) are
                # forked from it: their imports are paid now, once
                fork_context.warm(self.cfg.worker_thread_env())
            return self._monitor(client)
        except SignalException as e:
            if self.cfg.scaling_policy is not None and self._client is not None:
                code = self._leave(e.sigval)
                if code is not None:
                    return code
            self._stop_workers(e.sigval)
            self._tell_stopping(e.sigval.name)
            say(f"stopped by {e.sigval.name}; workers were sent {e.sigval.name}")
            return 128 + int(e.sigval)
        except Fenced as e:
            for w in self.workers + self.spares:  # now: they must not commit another step
                if w.running:
                    try:
                        os.kill(w.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self._stop_workers(signal.SIGKILL)
            say(f"node {self.cfg.node_rank} fenced itself: {e}; its workers were killed")
            return 1
        except JobFailed as e:
            self._stop_workers(signal.SIGTERM)
            say(f"job failed: {e}")
            if self._server and self.cfg.nnodes > 1:
                time.sleep(2 * self.cfg.heartbeat_interval_s)  # let the other agents hear why
            return 1
        finally:
            self._stop_workers(signal.SIGTERM)
            self.services.stop()
            if self._server:
                self._server.stop()
            if self._store:
                self._store.close()  # after it, this node's relay read fails at once
            if self._relay is not None:  # its thread may stay in a store read (RELAY_WAIT_S): hp run exits
                self._relay.stop()      # without the interpreter's teardown (hp.core.commands), not waiting for it
            if self._replica is not None:
                self._replica.stop()  # releases the lease if it leads: a standby takes over at once
            if self._forming is not None:
                self._forming.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _connect(self) -> ControlClient:
        if self.cfg.ha:
            return self._join_replicas()
        if self.cfg.hosts_controller:
            self._host_controller()
            self._address = self.cfg.controller_endpoint.host
            say(f"controller at {self._server.endpoint}, store at {self._store.host}:{self._store.port}, "
                f"logs in {self.log_dir}")
            return ControlClient(self._server.endpoint, self.token, node=self.cfg.node_rank)
        ep = self.cfg.controller_endpoint
        self._address = local_address(ep.host, ep.port)
        return ControlClient(str(ep), self.token, node=self.cfg.node_rank)

    def _host_controller(self) -> None:
        ep = self.cfg.controller_endpoint
        self._store = self.store_backend.serve(ep.host, 0)
        publish = sealing(self._store.store.set, self.token)  # workers refuse values not sealed with the token
        controller = self._new_controller(self._store.host, self._store.port, publish)
        self._server = ControlServer(controller, self.token, ep.host, ep.port).start()

    def _new_controller(self, store_host: str, store_port: int, publish, persist=None) -> Controller:
        config = ControllerConfig(
            nnodes=self.cfg.nnodes,
            max_nodes=self.cfg.max_nnodes,
            max_restarts=self.cfg.max_restarts,
            heartbeat_timeout_s=self.cfg.heartbeat_timeout_s,
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

        endpoints = self.cfg.store_endpoint
        self._address = local_address(*parse_endpoints(endpoints)[0])
        # the controller names one live node's store per generation for its ranks to form their group on:
        # as fast as a TCPStore, hosted by no rank, and another node's once this one is lost
        self._forming = get_backend("store", "tcp").serve(self._address or "127.0.0.1", 0)
        store = self.store_backend.connect(endpoints, DEFAULT_PORT, job=self.cfg.run_id)
        own = self.store_backend.connect(endpoints, DEFAULT_PORT, job=self.cfg.run_id)  # the replica's thread's
        self._replica = ControllerReplica(
            own, self.token, lambda persist: self._new_controller(endpoints, DEFAULT_PORT, sealing(own.set, self.token),
                                                                  persist),
            host=self._address or "127.0.0.1", port=self.cfg.controller_port, node=self.cfg.node_rank,
            ttl_s=self.cfg.controller_lease_s, say=say).start()
        resolver = LeaderResolver(store, self.token)
        endpoint = resolver.wait_for_other("", time.monotonic() + self.cfg.rdzv_timeout_s)
        if endpoint is None:
            raise JobFailed(f"no controller was elected within {self.cfg.rdzv_timeout_s:g} s (etcd at {endpoints})")
        say(f"controller elected among the agents, now at {endpoint} (etcd at {endpoints}, job {self.cfg.run_id}); "
            f"logs in {self.log_dir}")
        self._client = ControlClient(endpoint, self.token, node=self.cfg.node_rank, follow=resolver.wait_for_other)
        return self._client

    def _call_until(self, client: ControlClient, verb: Verb, payload: dict, done, what: str,
                    rejoin: bool = False) -> dict:
        """Retry ``verb`` until ``done(answer)`` or the rendezvous timeout; unreachable is retried.
        ``rejoin``: a 403 (this node is not a member) raises :class:`_Rejoin` instead of failing."""
        deadline = time.monotonic() + self.cfg.rdzv_timeout_s
        last_error = "no answer"
        while time.monotonic() < deadline:
            try:
                answer = client.call(verb, payload)
                if done(answer):
                    return answer
            except ControlPlaneError as e:
                if rejoin and e.status == 403:
                    raise _Rejoin() from None
                if e.status:  # an answer that refuses is final
                    raise JobFailed(str(e)) from None
                last_error = str(e)
            time.sleep(0.1)
        raise JobFailed(f"{what} timed out after {self.cfg.rdzv_timeout_s:.0f} s ({last_error})")

    def _rendezvous(self, client: ControlClient) -> Assignment:
        me = {"node_rank": self.cfg.node_rank}
        join = {**me, "nproc": self.cfg.nproc_per_node, "spares": self.cfg.spares, "host": socket.gethostname(),
                "address": self._address, "incarnation": os.environ.get(NODE_INCARNATION_ENV, ""),
                **({"forming_store": f"{self._forming.host}:{self._forming.port}"} if self._forming is not None else {})}
        while True:
            self._call_until(client, Verb.JOIN, join, lambda a: True, "joining the controller")
            try:
                a = self._call_until(client, Verb.RENDEZVOUS, me, lambda a: a["state"] != JobState.RENDEZVOUS,
                                     "rendezvous", rejoin=self.cfg.ha)
                break
            except _Rejoin:  # HA: a new leader took over during the rendezvous, which is not persisted
                say("the controller moved during the rendezvous: joining its new leader")
        if a["state"] != JobState.RUNNING:
            raise JobFailed(a.get("reason") or f"job is {a['state']}")
        self.generation = a["generation"]
        self._last_ok = time.monotonic()
        prefix = spare_id(self.cfg.node_rank, 0)[:-1]  # the ids name log files and heartbeat files
        if not all(isinstance(s, str) and s.startswith(prefix) and s[len(prefix):].isdigit() for s in a["spare_ids"]):
            raise JobFailed(f"the controller named spares {a['spare_ids']!r}, not {prefix}<k>")
        return Assignment(a["generation"], a["world_size"], a["rank_offset"], a["store_host"], a["store_port"],
                          a["spare_ids"])

    # ---- node services (hp.core.services) -----------------------------------------------
    def _start_services(self, client: ControlClient, a: Assignment) -> None:
        if not self.cfg.services:
            return
        node = NodeContext(run_id=self.cfg.run_id, node_rank=self.cfg.node_rank, nnodes=self.cfg.nnodes,
                           address=self._address, log_dir=self.log_dir, token=self.token)
        store = None if self.cfg.nnodes == 1 else self.store_backend.connect(a.store_host, a.store_port,
                                                                              job=self.cfg.run_id)

        def keep_alive() -> None:  # while waiting for the other nodes' services: stay a live node
            if self._call(client, Verb.HEARTBEAT, {})["state"] == JobState.FAILED:
                raise JobFailed("the job failed while node services were starting")

        try:
            self.services.start(node, store, self.cfg.rdzv_timeout_s, keep_alive)
        except ServiceError as e:
            self._tell_stopping(str(e))
            raise JobFailed(str(e)) from None
        say(f"node services started: {', '.join(self.cfg.services)}")

    # ---- workers ------------------------------------------------------------------------
    def _start_workers(self, a: Assignment, kind: type[Worker]) -> None:
        command = self._command = python_command(self.cfg.entrypoint, self.cfg.args, self.cfg.module)
        self._assignment = a
        os.makedirs(os.path.join(self.log_dir, "heartbeats"), exist_ok=True)
        tee = Std(self.cfg.tee)
        # one device slot (LOCAL_RANK) per process, spares included (hp.core.devices)
        self.devices = DeviceSlots(self.cfg.nproc_per_node + len(a.spare_ids))
        if a.rank_offset >= 0:
            for _ in range(self.cfg.nproc_per_node):
                local_rank = self.devices.take()  # 0, 1, ... in order
                rank = a.rank_offset + local_rank
                self.workers.append(kind(rank, local_rank, command, self.log_dir, tee, holder=worker_holder(rank, 0)))
        else:
            say(f"node {self.cfg.node_rank} joins a running job: its {self.cfg.nproc_per_node} process(es) "
                f"start as spares that the job grows into")
        for sid in a.spare_ids:
            self.spares.append(kind(-1, self.devices.take(), command, self.log_dir, tee, spare_id=sid,
                                    holder=spare_holder(sid)))
        self._next_spare = 1 + max((int(s.rpartition("s")[2]) for s in a.spare_ids), default=self.cfg.spares - 1)
        for w in self.workers + self.spares:
            with _starting():
                w.start(self._worker_env(w))

    def _worker_env(self, w: Worker) -> dict[str, str]:
        a = self._assignment
        env = {k: v for k, v in self.transport.env_defaults().items() if k not in os.environ}
        env.update(self.services.worker_env())
        env.update(self.cfg.worker_thread_env())
        env["LOCAL_RANK"] = str(w.local_rank)  # its device, a spare's too: it keeps it when promoted
        if w.spare_id is None:
            env.update({"RANK": str(w.rank), "ROLE_RANK": str(w.rank), "HP_ROLE": "worker"})
        else:  # a spare learns its rank from the controller when it is promoted
            env.update({"HP_ROLE": "spare", "HP_SPARE_ID": w.spare_id})
        w.heartbeat_file = os.path.join(self.log_dir, "heartbeats", f"{w.name}.attempt{w.restarts}")
        env.update({
            "WORLD_SIZE": str(a.world_size), "LOCAL_WORLD_SIZE": str(self.cfg.nproc_per_node),
            "GROUP_RANK": str(self.cfg.node_rank), "GROUP_WORLD_SIZE": str(self.cfg.nnodes),
            "ROLE_WORLD_SIZE": str(a.world_size), "ROLE_NAME": "default",
            "MASTER_ADDR": a.store_host, "MASTER_PORT": str(a.store_port),
            # the store is hosted by the controller: every rank, rank 0 included, is a client
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": self.cfg.run_id,
            "TORCHELASTIC_MAX_RESTARTS": str(self.cfg.max_restarts),
            "HP_GENERATION": str(self.generation),
            "HP_CONTROLLER": self._client_endpoint(),
            auth.TOKEN_ENV: self.token,
            "HP_TRANSPORT": self.transport.name,
            "HP_STORE": self.store_backend.name,
            "HP_STORE_JOB": self.cfg.run_id,  # the job's keys in a store many jobs share (etcd)
            "HP_CONTROLLER_HA": "1" if self.cfg.ha else "",  # follow the controller when another replica leads
            "HP_NODE_RANK": str(self.cfg.node_rank),
            "HP_RUN_ID": self.cfg.run_id,
            "HP_LOG_DIR": self.log_dir,
            "HP_HEARTBEAT_FILE": w.heartbeat_file,
            "HP_HOLDER": w.holder,
            AGENT_PID_ENV: str(os.getpid()),
        })
        if self._relay is not None:
            env.update(self._relay.env())
        if self.cfg.scaling_policy is not None:
            env[SCALING_POLICY_ENV] = os.path.abspath(self.cfg.scaling_policy)
        return env

    def _client_endpoint(self) -> str:
        if self._client is not None and self.cfg.ha:
            return self._client.endpoint  # the leader this agent last reached
        return self._server.endpoint if self._server else str(self.cfg.controller_endpoint)

    def _stop_workers(self, sig: signal.Signals) -> None:
        for w in self.workers + self.spares:
            w.stop(sig)

    # ---- monitoring ---------------------------------------------------------------------
    def _monitor(self, client: ControlClient) -> int:
        self._client = client
        next_beat = 0.0
        while True:
            for w in list(self.workers):
                if w.running and not w.hung and self.cfg.hang_timeout_s and w.silent_for() > self.cfg.hang_timeout_s:
                    say(f"rank {w.rank} (pid {w.pid}) hung: no heartbeat for {w.silent_for():.1f} s; killing it")
                    w.kill_hung()
                if w.running and (status := w.poll()) is not None:
                    if not status.ok:
                        self._on_failure(client, w)
                    elif self._exits.exited(w.holder, time.monotonic()):
                        next_beat = 0.0  # finished or scaled out: the membership read after the exit tells
            for w in list(self.spares):
                if not w.running or (status := w.poll()) is None:
                    continue
                self.spares.remove(w)
                if status.ok:  # only a spare given a rank ends by itself (this agent has not heard yet)
                    self.workers.append(w)
                    if self._exits.exited(w.holder, time.monotonic()):
                        next_beat = 0.0
                    continue
                w.finish()
                self.devices.release(w.local_rank)
                say(f"spare {w.spare_id} (pid {w.pid}) exited: {w.exit.describe()}")
                answer = self._call(client, Verb.SPARE_FAILED, {"spare": w.spare_id}, fenced=True)
                if "action" in answer:  # promoted before this agent heard of it: a rank died
                    w.rank = answer.get("rank", w.rank)
                    self._act(w, answer)
            if time.monotonic() >= next_beat:
                asked = time.monotonic()
                next_beat = asked + self.cfg.heartbeat_interval_s
                beat = self._call(client, Verb.HEARTBEAT, {})
                for line in self.services.check():
                    say(line)
                self.generation = max(self.generation, beat["generation"])
                self._renumber(beat.get("ranks", {}), asked)
                for promotion in beat.get("promotions", []):
                    self._promote(promotion)
                self._cut_lost(beat.get("lost", []))
                self._follow_capacity(client)
                if beat["state"] == JobState.FAILED:
                    raise JobFailed(beat["reason"])
                if beat["state"] == JobState.PREEMPTED:
                    return self._preempted(client, time.monotonic() + self.cfg.grace_period_s)
                if beat["state"] == JobState.SUCCEEDED:
                    return 0
            self._scaled_out()
            if not self._done_reported and self.workers and all(
                    w.exit and w.exit.ok and self._exits.verdict(w.holder) is Verdict.FINISHED for w in self.workers):
                for spare in self.spares:
                    spare.stop(signal.SIGTERM)  # nothing left on this node for a spare to replace
                self.spares.clear()
                done = self._call(client, Verb.NODE_DONE, {}, fenced=True)
                self._done_reported = True
                if done["state"] == JobState.PREEMPTED:  # they saved and exited before a heartbeat told us
                    return self._preempted(client, time.monotonic() + self.cfg.grace_period_s)
                if not self.cfg.hosts_controller:
                    say(f"node {self.cfg.node_rank}: all {len(self.workers)} workers succeeded")
                    return 0
                next_beat = 0.0
            time.sleep(self.cfg.monitor_interval_s)

    def _call(self, client: ControlClient, verb: Verb, payload: dict, fenced: bool = False) -> dict:
        """One request stamped with this node and generation. A stale-generation refusal is
        answered by catching up to the controller's generation and asking again, once; an
        unreachable controller is retried until this node's lease ends (then :class:`Fenced`)."""
        caught_up = False
        while True:
            sent = time.monotonic()
            # no request may outlast the lease: the fencing deadline holds even when packets vanish
            lease_left = self._last_ok + self.cfg.fence_after_s - sent
            try:
                answer = client.call(verb, {**payload, "node_rank": self.cfg.node_rank, "generation": self.generation},
                                     timeout_s=min(10.0, max(0.2, lease_left)))
                self._last_ok = max(self._last_ok, sent)
                return answer
            except ControlPlaneError as e:
                if not e.status:
                    silent = time.monotonic() - self._last_ok
                    if silent > self.cfg.fence_after_s:
                        raise Fenced(f"no answer from the controller at {client.endpoint} for {silent:.1f} s "
                                     f"(lease {self.cfg.fence_after_s:g} s, generation {self.generation}): {e}") from None
                    time.sleep(min(0.2, self.cfg.heartbeat_interval_s))
                    continue
                if fenced and not caught_up and e.status == 409 and "generation" in e.body:
                    self.generation, caught_up = e.body["generation"], True
                    continue
                raise JobFailed(e.body.get("reason") or str(e)) from None

    def _on_failure(self, client: ControlClient, w: Worker) -> None:
        st = w.exit
        say(f"rank {w.rank} (pid {st.pid}) failed: {st.describe()}; reporting to the controller")
        decision = self._call(client, Verb.WORKER_FAILED, {
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
        self.generation = max(self.generation, decision["generation"])
        if action == FailureAction.RESTART:
            w.restarts, w.holder, w.rank = w.restarts + 1, decision["holder"], decision["rank"]
            if w not in self.workers:  # a spare given a rank before this agent heard of it
                self.workers.append(w)
            with _starting():
                w.start(self._worker_env(w))
            say(f"restarted rank {w.rank} as pid {w.pid} (generation {self.generation}, restart {w.restarts})")
            return
        if w in self.workers:
            self.workers.remove(w)  # the rank now lives in a spare process, here or on another node
        self.devices.release(w.local_rank)  # for the process that replaces it here
        if action == FailureAction.SHRINK:
            say(f"rank {w.rank}: no spare left; the job goes on with {decision['world_size']} ranks "
                f"(generation {self.generation}); a new process takes the freed slot and joins when ready")
            self._add_spare(joiner=True)
        elif action == FailureAction.PROMOTE_SPARE:
            self._promote(decision)
        else:
            say(f"rank {w.rank} moved to a spare on node {decision['node']} (generation {self.generation})")

    def _promote(self, promotion: dict) -> None:
        spare = next((s for s in self.spares if s.spare_id == promotion["spare"]), None)
        if spare is None:
            return  # it died meanwhile; its own exit is reported as a worker failure of that rank
        self.spares.remove(spare)
        spare.rank = promotion["rank"]
        self.workers.append(spare)
        say(f"spare {spare.spare_id} (pid {spare.pid}) now holds rank {spare.rank} "
            f"(generation {promotion['generation']})")
        if self.cfg.replenish_spares:
            self._add_spare()

    def _follow_capacity(self, client: ControlClient) -> None:
        """Elastic, on the node hosting the controller: the scheduler's capacity, when it changed, becomes
        the job's (the controller shrinks or grows at a step boundary)."""
        if self._server is None or self.cfg.capacity_file is None:
            return
        replicas = get_backend("scheduler", self.cfg.scheduler).capacity(self.cfg.capacity_file).replicas
        if replicas is None or replicas == self._capacity:
            return
        self._capacity = replicas
        try:
            answer = client.call(Verb.SCALE, {"replicas": replicas})
            say(f"capacity {replicas}: the job runs {answer['world_size']} ranks (generation {answer['generation']})")
        except ControlPlaneError as e:
            say(f"capacity {replicas}: {e}")

    def _renumber(self, ranks: dict[str, int], asked: float) -> None:
        """The controller's ranks of this node's processes, by holder id (scale events renumber them), in
        answer to a heartbeat sent at ``asked``."""
        self._exits.heard(set(ranks), asked)
        for w in self.workers:
            w.rank = ranks.get(w.holder, w.rank)

    def _scaled_out(self) -> None:
        """Elastic: a worker that exited 0 holding no rank any more was scaled out (``hp scale``, capacity):
        its slot gets a new process that waits as a joiner, so the job can grow back into it."""
        if self.scaler is None:
            return
        for w in [w for w in self.workers
                  if w.exit and w.exit.ok and self._exits.verdict(w.holder) is Verdict.SCALED_OUT]:
            self.workers.remove(w)
            self.devices.release(w.local_rank)
            say(f"{w.holder} left the job (scaled out); a new process keeps its slot for when the job grows")
            self._add_spare(joiner=True)

    def _add_spare(self, joiner: bool = False) -> None:
        """Replace a promoted spare (or, ``joiner``, a rank the job shrank without: the job grows back into
        it once it is ready): a new process with a never-used id, registered as free. It starts while the
        job trains, so it is forked with torch already imported (hp.core.forkserver)."""
        sid = spare_id(self.cfg.node_rank, self._next_spare)
        self._next_spare += 1
        w = forkserver.ForkedWorker(-1, self.devices.take(), self._command, self.log_dir, Std(self.cfg.tee),
                                    spare_id=sid, holder=spare_holder(sid))
        with _starting():
            w.start(self._worker_env(w))
            self.spares.append(w)
        self._call(self._client, Verb.SPARE_ADDED, {"spare": sid, "joiner": joiner}, fenced=True)
        say(f"started spare {sid} (pid {w.pid}, forked with torch imported) to replace the "
            f"{'dead rank' if joiner else 'promoted one'}")

    def _cut_lost(self, addresses: list[str]) -> None:
        """Cut this node's TCP connections to lost nodes: a survivor blocked in a collective with
        a partitioned peer (whose packets vanish) is released now instead of at the group's timeout."""
        for address in addresses:
            if address in self._cut or address in (self._address, self.cfg.controller_endpoint.host) \
                    or address.startswith("127.") or address == "::1":
                continue  # never our own or a loopback address (nodes sharing one host)
            self._cut.add(address)
            if shutil.which("ss") is None:
                say(f"lost node {address}: `ss` missing, survivors wait for the process group timeout")
                continue
            done = subprocess.run(["ss", "-K", "dst", address], capture_output=True, text=True)
            say(f"lost node {address}: cut this node's connections to it"
                if done.returncode == 0 else f"lost node {address}: could not cut connections: {done.stderr.strip()}")

    def _leave(self, sig: signal.Signals) -> int | None:
        """Elastic: a SIGTERM is a preemption. Ask the controller to let this node's ranks leave at the next
        step boundary and wait (at most the grace period) for them to exit: 0 once they did, or once those
        still running at its end are killed (the job goes on without them). Where the job cannot go on without
        this node (below the policy's minimum, or it hosts the controller) the job is preempted: its ranks save
        their last committed step and exit (:meth:`_preempted`). None: stop as a fixed-size job does (the
        controller could not be asked, or refused)."""
        deadline = time.monotonic() + self.cfg.grace_period_s
        try:
            answer = self._call(self._client, Verb.NODE_LEAVING,
                                {"signal": sig.name, "hosts_controller": self._server is not None}, fenced=True)
        except (JobFailed, Fenced) as e:
            say(f"{sig.name}: could not leave gracefully ({e})")
            return None
        if answer.get("action") == FailureAction.SAVE:
            return self._preempted(self._client, deadline)
        if answer.get("action") != FailureAction.LEAVE:
            say(f"{sig.name}: the job cannot shrink without this node ({answer.get('reason')}); stopping")
            return None
        for spare in list(self.spares):
            if spare.spare_id in answer.get("spares", []):
                spare.stop(signal.SIGTERM)
            else:  # promoted since the last heartbeat: it holds a rank that leaves at the boundary
                self.spares.remove(spare)
                self.workers.append(spare)
        say(f"{sig.name}: this node's ranks leave the job at the next step boundary (generation "
            f"{answer['generation']}, {answer['world_size']} ranks stay; grace {self.cfg.grace_period_s:g} s)")
        while time.monotonic() < deadline:
            if self._workers_exited():
                say("left the job gracefully")
                return 0
            time.sleep(self.cfg.monitor_interval_s)
        # the job already goes on without this node (the controller made the generation without it): what is
        # left here is a process still exiting, or a rank that never reached the boundary (the others replay
        # that step). Telling the controller this node stopped would fail a job this node has left.
        say(f"grace period of {self.cfg.grace_period_s:g} s over: killing this node's processes still running; "
            f"the job goes on without them")
        self._stop_workers(signal.SIGKILL)
        return 0

    def _workers_exited(self) -> bool:
        return all(w.poll() is not None for w in self.workers if w.running)

    def _preempted(self, client: ControlClient, deadline: float) -> int:
        """The job is preempted (``JobState.PREEMPTED``): this node's ranks abandon their step, save the last
        committed one and exit by themselves. Wait for them until ``deadline`` (the grace period); the node
        hosting the controller (and the store the ranks save through) then waits for every other node's.
        Ranks still running at the deadline are killed: a restart resumes from the newest complete
        checkpoint, an older one."""
        say(f"the job is preempted: its ranks save their last committed step, then stop "
            f"({max(deadline - time.monotonic(), 0):.0f} s of grace left)")
        while time.monotonic() < deadline:
            if self._workers_exited():
                try:
                    if not self._done_reported:
                        self._call(client, Verb.NODE_DONE, {}, fenced=True)
                        self._done_reported = True
                    finished = self._server is None or self._call(client, Verb.HEARTBEAT, {}).get("finished")
                except (JobFailed, Fenced) as e:  # this node's part is done; the controller's answer only informs
                    say(f"preempted: the controller could not be told this node's ranks saved ({e})")
                    return EXIT_PREEMPTED
                if finished:
                    say("the job's ranks saved their last committed step and stopped (preempted)")
                    return EXIT_PREEMPTED
            time.sleep(self.cfg.monitor_interval_s)
        say("grace period over before every rank saved: stopping; a restart resumes from the newest complete checkpoint")
        return EXIT_PREEMPTED

    def _tell_stopping(self, why: str) -> None:
        try:
            ControlClient(self._client_endpoint(), self.token, timeout_s=2, node=self.cfg.node_rank).call(
                Verb.NODE_STOPPING, {"node_rank": self.cfg.node_rank, "generation": self.generation, "reason": why})
        except ControlPlaneError:
            pass  # the controller may be gone already; stopping goes on regardless


def local_address(host: str, port: int) -> str:
    """The address this host uses to reach ``host`` (no packet is sent: a UDP connect only routes)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return s.getsockname()[0]
    except OSError:
        return ""

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

The parts, one idea each: :mod:`.link` (the controller, requests under the fencing lease), :mod:`.rendezvous`
(joining, node services), :mod:`.pool` (workers and spares), :mod:`.env` (their environment, pure),
:mod:`.monitor` (the loop), :mod:`.departure` (leave, preemption), :mod:`.cuts` (lost nodes' connections),
:mod:`.signals` (SIGTERM/SIGINT held while a worker starts). :class:`Agent` wires them and maps how the run
ended to ``hp run``'s exit code.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.api import SignalException

from hp.core import fork_context, forkserver, health
from hp.core.agent.cuts import Cuts
from hp.core.agent.departure import Departure
from hp.core.agent.env import worker_env
from hp.core.agent.link import Fenced, JobFailed, Link, local_address
from hp.core.agent.messages import say
from hp.core.agent.monitor import Monitor
from hp.core.agent.pool import Pool
from hp.core.agent.rendezvous import Assignment, rendezvous, start_services
from hp.core.agent.signals import SignalDeferral
from hp.core.config import RunConfig
from hp.core.errors import UsageError
from hp.core.fanout import RELAY_WAIT_S, Relay
from hp.core.plugins import get_backend, load_scaler
from hp.core.scaling import Scaler
from hp.core.services import ServiceHost
from hp.core.workers import Worker

__all__ = ["Agent", "Assignment", "Fenced", "JobFailed", "local_address", "say"]


class Agent:
    def __init__(self, config: RunConfig, token: str, scaler: Scaler | None = None) -> None:
        config.validate()
        self.cfg = config
        self.token = token
        self.transport = get_backend("transport", config.launch.transport)
        self.transport.check_available()
        health.min_free_mb(os.environ)  # a bad health-check setting: one line now, not in a recovery
        self.store_backend = get_backend("store", config.rendezvous.store)
        self.services = ServiceHost(config.launch.services)
        if scaler is None and config.elastic.scaling_policy is not None:  # a bad policy: one line, before anything starts
            scaler = load_scaler(config.elastic.scaling_policy)
        self.scaler = scaler
        self.log_dir = config.logging.log_dir or tempfile.mkdtemp(prefix=f"hp_{config.launch.run_id}_")
        try:
            os.makedirs(self.log_dir, exist_ok=True)
        except OSError as e:  # under /proc, a file in the way, no permission: one line, nothing started
            raise UsageError(f"--log-dir {self.log_dir}: {e.strerror or e}") from None
        self.signals = SignalDeferral()
        self.link = Link(config, token, self.store_backend, scaler, self.log_dir)
        self.pool = Pool(config, self.log_dir, self.env_for, self.signals.starting, self.link.tell)
        self.departure = Departure(config, self.link, self.pool)
        self.assignment: Assignment | None = None  # once the rendezvous gave it
        self.relay: Relay | None = None  # forwards the membership to this node's workers (hp.core.fanout)

    def run(self) -> int:
        """Run this node's part of the job; returns the exit code for ``hp run``."""
        previous = self.signals.install()
        forked = self.cfg.launch.start_method == "forkserver"
        try:
            if forked:  # every worker is forked from it: torch is imported once, before this node joins (hp run
                fork_context.warm(self.cfg.worker_thread_env(), wait=True)  # started it: hp.core.commands)
            client = self.link.connect()
            a = self.assignment = rendezvous(self.cfg, self.link, client)
            start_services(self.cfg, self.services, self.link, client, a, self.store_backend, self.log_dir, self.token)
            if self.cfg.rendezvous.node_relay:
                # connecting is bounded like a read (RELAY_WAIT_S): torch retries a refused connect in C++
                self.relay = Relay(lambda: self.store_backend.connect(a.store_host, a.store_port,
                                                                      timedelta(seconds=RELAY_WAIT_S),
                                                                      job=self.cfg.launch.run_id),
                                   self.token, self.cfg.launch.node_rank, a.generation, log=say).start()
            self.pool.start(a, forkserver.ForkedWorker if forked else Worker)
            if not forked and ((self.cfg.fault_tolerance.replenish_spares and self.cfg.fault_tolerance.spares) or self.cfg.elastic.scaling_policy is not None):
                # replacements (and, elastic, the new process of a rank the job shrank without) are
                # forked from it: their imports are paid now, once
                fork_context.warm(self.cfg.worker_thread_env())
            cuts = Cuts((self.link.address, self.cfg.rendezvous.controller_endpoint.host))
            return Monitor(self.cfg, self.link, self.pool, self.departure, self.services, cuts,
                           elastic=self.scaler is not None).run(client)
        except SignalException as e:
            if self.cfg.elastic.scaling_policy is not None and self.link.client is not None:
                code = self.departure.leave(e.sigval)
                if code is not None:
                    return code
            self.pool.stop(e.sigval)
            self.link.tell_stopping(e.sigval.name)
            say(f"stopped by {e.sigval.name}; workers were sent {e.sigval.name}")
            return 128 + int(e.sigval)
        except Fenced as e:
            self.pool.kill()  # now: they must not commit another step
            self.pool.stop(signal.SIGKILL)
            say(f"node {self.cfg.launch.node_rank} fenced itself: {e}; its workers were killed")
            return 1
        except JobFailed as e:
            self.pool.stop(signal.SIGTERM)
            say(f"job failed: {e}")
            if self.link.hosts_controller and self.cfg.launch.nnodes > 1:
                time.sleep(2 * self.cfg.fault_tolerance.heartbeat_interval_s)  # let the other agents hear why
            return 1
        finally:
            self.pool.stop(signal.SIGTERM)
            self.services.stop()
            self.link.close_controller()  # after it, this node's relay read fails at once
            if self.relay is not None:  # its thread may stay in a store read (RELAY_WAIT_S): hp run exits
                self.relay.stop()       # without the interpreter's teardown (hp.core.commands), not waiting for it
            self.link.close_replica()
            self.signals.restore(previous)

    def env_for(self, w: Worker) -> dict[str, str]:
        """The environment ``w`` starts with now (the generation and controller this node knows now)."""
        a = self.assignment
        return worker_env(w, self.cfg, world_size=a.world_size, store_host=a.store_host, store_port=a.store_port,
                          generation=self.link.generation, controller=self.link.endpoint(), token=self.token,
                          transport=self.transport.name, store=self.store_backend.name, log_dir=self.log_dir,
                          agent_pid=os.getpid(), transport_defaults=self.transport.env_defaults(),
                          services_env=self.services.worker_env(),
                          relay_env=self.relay.env() if self.relay is not None else {}, outer_env=os.environ)

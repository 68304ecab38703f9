"""Run one job of a scenario (the fault-free reference or the faulted one) and act on it meanwhile.

The job is ``hp run`` of the demo GPT (:func:`hp.checkpointless.demo.run.job_command`), one agent
per node: on loopback for ``nodes: 1``, in a network namespace per node
(:class:`hp.chaos.topology.Topology`) otherwise. While it runs, the events its processes record
(:mod:`hp.checkpointless.events`) are tailed, so the runner's actions (a signal to a spare, an
iptables rule) can fire at a step; the runner records its own actions into the same event log.

An elastic job (``job.elastic``) is the same command with :mod:`hp.elastic.demo.train` as the
script and ``--nnodes NODES:MAX_NODES --scaling-policy FILE`` (the policy written into the run's
log directory); it gets a namespace per node it may ever have (``max_nodes``), so a node that
joins later (a ``join`` fault: :meth:`Live.start_agent`) has its own address too.

With ``job.store: etcd`` the runner starts a private etcd (:class:`hp.core.etcd_store.EtcdServer`)
for the run, on loopback for one node or on the host's address on the namespaces' bridge
(:meth:`hp.chaos.topology.Topology.host_address`: every node reaches it, no node's fault takes it
down), and gives every agent ``--store etcd --rdzv-endpoint <etcd> --run-id <the run's id>``
instead of a controller endpoint: the agents elect the controller among them. Each node's agent
logs its own controller decisions (a new leader's ``controller_elected`` among them), so the run's
decision log is every node's ``controller_decisions.jsonl`` merged by time (:func:`read_decisions`);
the controller's process (a ``controller`` target) is the agent of the node the last
``controller_elected`` names (node 0 before any), and the job's outcome is that agent's exit code.
etcd is stopped when the run ends, however it ends; its log is kept as ``etcd.log`` in the run's
log directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hp.chaos.faults.base import Action
from hp.chaos.scenario import JobSpec
from hp.chaos.stacks import dump as dump_stacks
from hp.checkpointless.demo.run import DemoConfig, RunResult, job_command
from hp.checkpointless.events import EventLog, read_events
from hp.core import auth
from hp.core.protocol import Decision, Event
from hp.core.procs import HP, free_port, kill_tagged, tagged_pids

POLL_S = 0.02
TAG_ENV = "HP_CHAOS_RUN"  # every process of a run inherits it: stragglers are found and killed by it
FIXED_TRAIN, ELASTIC_TRAIN = "hp.checkpointless.demo.train", "hp.elastic.demo.train"
POLICY_FILE = "policy.yaml"
DECISIONS_FILE = "controller_decisions.jsonl"  # in each node's log directory (hp run --log-dir)


def demo_config(job: JobSpec, spares: int | None = None, train_args: list[str] = ()) -> DemoConfig:
    return DemoConfig(nproc=job.nproc_per_node, spares=job.spares if spares is None else spares, steps=job.steps,
                      model_size=job.model, hang_timeout_s=job.hang_timeout_s, corpus_mb=job.corpus_mb,
                      seed=job.seed, max_restarts=job.max_restarts, train_args=list(train_args))


def agent_flags(nnodes: int, node: int, endpoint: str | None, extra: Sequence[str] = (),
                max_nodes: int | None = None) -> list[str]:
    """``hp run`` flags of one node of an ``nnodes`` job whose controller is at ``endpoint``;
    ``max_nodes`` (elastic): ``--nnodes NNODES:MAX_NODES``."""
    flags = list(extra)
    if max_nodes is not None:
        flags += ["--nnodes", f"{nnodes}:{max_nodes}", "--node-rank", str(node)]
    elif nnodes > 1:
        flags += ["--nnodes", str(nnodes), "--node-rank", str(node)]
    if endpoint:
        flags += ["--rdzv-endpoint", endpoint]
    return flags


def write_policy(job: JobSpec, log_dir: str) -> tuple[str, list[str]]:
    """Write the elastic job's scaling policy into ``log_dir``: its path, and the elastic script's
    flags for it (``--policy PATH``, ``--exact``)."""
    from hp.elastic.demo.run import POLICY

    e = job.elastic
    path = os.path.join(log_dir, POLICY_FILE)
    with open(path, "w") as f:
        f.write(POLICY.format(min=e.min_replicas, max=e.max_replicas, global_batch=e.global_batch,
                              micro_batch=e.micro_batch))
    return path, ["--policy", path, *(["--exact"] if e.exact else [])]


def node_command(job: JobSpec, cfg: DemoConfig, log_dir: str, node: int, endpoint: str | None,
                 policy: str | None = None, run_id: str | None = None) -> list[str]:
    """``hp run`` of one node: the demo's command with the job's agent flags added; an elastic job
    (``policy``: its scaling policy file) runs the elastic demo script under that policy. With
    ``job.store: etcd``, ``endpoint`` is the etcd's and ``run_id`` the job's id (the same on every node)."""
    flags = ["--heartbeat-timeout", str(job.heartbeat_timeout_s)]
    if job.store == "etcd":
        if not endpoint or not run_id:
            raise ValueError("a job on the etcd store needs the etcd endpoint and a run id")
        flags += ["--store", "etcd", "--run-id", run_id]
    if job.replenish_spares:
        flags.append("--replenish-spares")
    if job.controller == "standalone":
        flags.append("--external-controller")
    if job.elastic is None:
        return job_command(cfg, log_dir, agent_flags(job.nodes, node, endpoint, flags))
    argv = job_command(cfg, log_dir, agent_flags(job.nodes, node, endpoint, [*flags, "--scaling-policy", policy],
                                                 max_nodes=job.max_nodes))
    argv[argv.index(FIXED_TRAIN)] = ELASTIC_TRAIN  # same flags (--steps, --model-size, --corpus-mb, --seed)
    return argv


def start_agent(topo: Any, node: int, argv: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen:
    """One node's agent: inside the node's namespace with gloo on its veth, or on loopback without
    a topology."""
    if topo is None:
        return subprocess.Popen(argv, env=env, **popen)
    return topo.run_in(node, argv, {**env, "GLOO_SOCKET_IFNAME": topo.ifname(node)}, **popen)


def controller_command(job: JobSpec, host: str, port: int, log_dir: str, policy: str | None = None) -> list[str]:
    """A standalone ``hp controller`` (and its store) for the job, as on Kubernetes."""
    nnodes = str(job.nodes) if job.elastic is None else f"{job.nodes}:{job.max_nodes}"
    return [*HP, "controller", "--nnodes", nnodes, "--host", host, "--port", str(port),
            "--max-restarts", str(job.max_restarts), "--heartbeat-timeout", str(job.heartbeat_timeout_s),
            "--decision-log", os.path.join(log_dir, "controller_decisions.jsonl"),
            *(["--scaling-policy", policy] if policy else [])]


def read_decisions(dirs: Sequence[str]) -> list[dict]:
    """The job's controller decisions: every node's ``controller_decisions.jsonl`` (in each of
    ``dirs``, the nodes' log directories) merged, oldest first. With the tcp store only the
    controller's node has one; with etcd each leader logs into its own node's. A last line without
    its newline (an agent SIGKILLed while writing it) is left out."""
    decisions = []
    for d in dirs:
        path = os.path.join(d, DECISIONS_FILE)
        if os.path.exists(path):
            decisions += _read_new(path, {})
    return sorted(decisions, key=lambda d: d["t"])  # a stable sort: one node's order is kept for equal times


def leader_node(decisions: Sequence[dict]) -> int:
    """The node whose agent leads the job after ``decisions``: the last ``controller_elected``
    decision's ``node_rank``, or node 0 before any (the tcp store's controller node)."""
    for d in reversed(decisions):
        node = d.get("node_rank")
        if d.get("decision") == Decision.CONTROLLER_ELECTED and (type(node) is int or str(node).isdigit()):
            return int(node)  # (an integer; early HA builds wrote it as a string)
    return 0


def _read_new(path: str, offsets: dict[str, int]) -> list[dict]:
    """The complete JSON lines appended to ``path`` since the last call (a line being written is
    read next time)."""
    with open(path) as f:
        f.seek(offsets.get(path, 0))
        chunk = f.read()
    complete = chunk[:chunk.rfind("\n") + 1]
    offsets[path] = offsets.get(path, 0) + len(complete.encode())
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


class _Tail:
    """Incremental reader of a job's JSON-lines event files (one per process, appended to)."""

    def __init__(self, dirs: list[str]) -> None:
        self.dirs, self.events = dirs, []
        self._offsets: dict[str, int] = {}

    def poll(self) -> list[dict]:
        new = []
        for d in self.dirs:
            for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                new += _read_new(os.path.join(d, name), self._offsets)
        new.sort(key=lambda e: e["t"])
        self.events += new
        return new


class _DecisionTail:
    """Incremental reader of the nodes' decision logs (``node_dirs``: the run's list, which a join
    extends), merged by time like :func:`read_decisions`."""

    def __init__(self, node_dirs: list[str]) -> None:
        self.node_dirs, self.decisions = node_dirs, []
        self._offsets: dict[str, int] = {}

    def poll(self) -> None:
        new = []
        for d in self.node_dirs:
            path = os.path.join(d, DECISIONS_FILE)
            if os.path.exists(path):
                new += _read_new(path, self._offsets)
        if new:
            self.decisions = sorted(self.decisions + new, key=lambda d: d["t"])


@dataclass
class Live:
    """The running job as actions see it (:class:`hp.chaos.faults.base.LiveJob`)."""

    agents: list[subprocess.Popen]
    tail: _Tail
    log: EventLog
    storage: Any = None
    topology: Any = None
    spares_per_node: int = 1
    controller: subprocess.Popen | None = None  # a standalone `hp controller`, else node 0's agent hosts it
    starter: Callable[[int, str], subprocess.Popen] | None = None  # (node, log dir name) -> a new agent
    etcd: Any = None  # job.store etcd: the run's hp.core.etcd_store.EtcdServer (the agents elect the controller)
    decision_log: _DecisionTail | None = None  # the nodes' controller decisions (read with etcd only)
    endpoint: str | None = None  # the controller's HOST:PORT (tcp store), for hp finish
    token: str | None = None  # the job token, for hp finish
    _committed: int = -1
    _spares: dict[str, int] = field(default_factory=dict)
    _ranks: dict[int, tuple[int, float, int]] = field(default_factory=dict)  # rank -> (generation, t, pid)
    _node_agents: dict[int, subprocess.Popen] = field(default_factory=dict)  # node -> its newest agent

    def __post_init__(self) -> None:
        self._node_agents.update(enumerate(self.agents))

    def update(self) -> None:
        if self.decision_log is not None:
            self.decision_log.poll()
        for e in self.tail.poll():
            if e["event"] == Event.COMMIT and e.get("rank") == 0:
                self._committed = max(self._committed, e["step"])
            elif e["event"] == Event.SPARE_READY:
                self._spares[e["spare"]] = e["pid"]
            rank, generation = e.get("rank"), e.get("generation")
            if type(rank) is int and type(generation) is int and e["event"] != Event.FAULT_INJECTED \
                    and (generation, e["t"]) >= self._ranks.get(rank, (-1, 0.0, 0))[:2]:
                self._ranks[rank] = (generation, e["t"], e["pid"])  # a scale event renumbers ranks

    def committed(self) -> int:
        return self._committed

    def events(self) -> list[dict]:
        return self.tail.events

    def spare_pid(self, spare: int) -> int | None:
        per_node = max(1, self.spares_per_node)
        return self._spares.get(f"n{spare // per_node}s{spare % per_node}")

    def decisions(self) -> list[dict]:
        """The controller decisions logged so far (oldest first): read with the etcd store only."""
        return self.decision_log.decisions if self.decision_log is not None else []

    def leader(self) -> int:
        """The node whose agent hosts the controller now: node 0, or with etcd the last one elected."""
        return leader_node(self.decisions()) if self.etcd is not None else 0

    def controller_pid(self) -> int | None:
        """The controller's process: the standalone controller, node 0's agent, or with etcd the
        leading node's agent while it runs (None between its death and the next election)."""
        if self.etcd is not None:
            return self.agent_pid(self.leader())
        return (self.controller or self.agents[0]).pid

    def outcome_agent(self) -> subprocess.Popen:
        """The agent whose exit code is the job's: node 0's, or with etcd the last elected leader's."""
        return self._node_agents.get(self.leader(), self.agents[0]) if self.etcd is not None else self.agents[0]

    def rank_pid(self, rank: int) -> int | None:
        """The process that holds ``rank`` in the newest generation its events show."""
        return self._ranks[rank][2] if rank in self._ranks else None

    def agent_pid(self, node: int) -> int | None:
        agent = self._node_agents.get(node)
        return agent.pid if agent is not None and agent.poll() is None else None

    def start_agent(self, node: int, name: str) -> int:
        """A new agent for ``node`` (logs under ``name``), watched and reaped like the first ones."""
        if self.starter is None:
            raise RuntimeError("this run cannot start agents")
        agent = self.starter(node, name)
        self.agents.append(agent)
        self._node_agents[node] = agent
        return agent.pid

    def record(self, event: str, **fields: Any) -> None:
        self.log.record(event, **fields)

    def finish(self, reason: str) -> None:
        """``hp finish``: the controller tells every rank, in the same commit vote, to end after that step."""
        from hp.core.control_plane import request_finish

        if self.endpoint is None or self.token is None or self.etcd is not None:
            raise RuntimeError("this run has no controller endpoint and job token to ask to finish")
        if self.topology is not None:
            self.topology.host_address()  # the host's own address on the nodes' bridge: a route to node 0
        request_finish(self.endpoint, self.token, reason)


@dataclass
class JobRun:
    result: RunResult
    timed_out: bool
    orphans_killed: int  # processes of the job still alive after its agents ended
    action_errors: list[str]
    agent_returncodes: list[int] = field(default_factory=list)  # per agent: one per node, then joined ones
    agent_pids: list[int] = field(default_factory=list)  # the same agents' pids
    decisions: list[dict] = field(default_factory=list)  # every node's controller decisions, oldest first
    store: str = "tcp"  # the job's store (job.store)
    stacks: dict[int, tuple[str, str]] = field(default_factory=dict)  # timed out: each live process's title
    # and stacks, taken before it was killed (hp.chaos.stacks)


def run_job(job: JobSpec, log_dir: str, hp_faults: list[dict], actions: list[Action] = (),
            env: dict[str, str] | None = None, spares: int | None = None, storage: Any = None,
            train_args: list[str] = ()) -> JobRun:
    """Run the job to its end (or ``job.timeout_s``), firing ``actions`` on the way; every process
    it started is gone when this returns. ``train_args``: extra flags for the training script."""
    os.makedirs(log_dir, exist_ok=True)
    tag = uuid.uuid4().hex
    policy = None
    if job.elastic is not None:
        policy, elastic_args = write_policy(job, log_dir)
        train_args = [*train_args, *elastic_args]
    cfg = demo_config(job, spares, train_args)
    # exact mode needs the same thread count in every process, whatever its node's rank count
    threads = {"OMP_NUM_THREADS": "1"} if job.elastic is not None else {}
    base_env = {**os.environ, **threads, **(env or {}), "HP_FAULTS": json.dumps(hp_faults), TAG_ENV: tag}
    with contextlib.ExitStack() as stack:
        topo = None
        if job.max_nodes > 1:
            from hp.chaos.topology import Topology

            topo = stack.enter_context(Topology(job.max_nodes))  # a node joining later has its namespace too
            base_env.setdefault(auth.TOKEN_ENV, auth.new_token())
        out = stack.enter_context(open(os.path.join(log_dir, "job.out"), "w"))
        node_dirs = [log_dir] if job.max_nodes == 1 else [os.path.join(log_dir, f"node{i}") for i in range(job.nodes)]
        host = topo.address(0) if topo else "127.0.0.1"
        endpoint = f"{host}:{free_port()}" if topo or job.controller == "standalone" or policy else None
        if job.finish_after:  # the runner asks the controller to finish: with the job token
            base_env.setdefault(auth.TOKEN_ENV, auth.new_token())
        etcd, run_id = None, None
        if job.store == "etcd":  # every agent is a controller candidate; the store is etcd, outside every node
            etcd = _start_etcd(stack, topo.host_address() if topo else "127.0.0.1", log_dir)
            endpoint, run_id = etcd.endpoint, f"chaos-{tag[:12]}"
            base_env.setdefault(auth.TOKEN_ENV, auth.new_token())  # one job token: a leader's state is sealed with it
        agents, controller = [], None
        start = time.monotonic()
        if job.controller == "standalone":
            base_env.setdefault(auth.TOKEN_ENV, auth.new_token())
            argv = controller_command(job, host, int(endpoint.rsplit(":", 1)[1]), node_dirs[0], policy)
            kw = {"stdout": out, "stderr": subprocess.STDOUT, "start_new_session": True}
            controller = topo.run_in(0, argv, base_env, **kw) if topo else subprocess.Popen(argv, env=base_env, **kw)

        def start_node(node: int, node_dir: str) -> subprocess.Popen:
            return start_agent(topo, node, node_command(job, cfg, node_dir, node, endpoint, policy, run_id),
                               base_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def join(node: int, name: str) -> subprocess.Popen:  # a join fault: a new agent, its own log dir
            node_dirs.append(os.path.join(log_dir, name))
            live.tail.dirs.append(os.path.join(node_dirs[-1], "events"))
            return start_node(node, node_dirs[-1])

        for i, node_dir in enumerate(list(node_dirs)):
            agents.append(start_node(i, node_dir))
        live = Live(agents, _Tail([os.path.join(d, "events") for d in node_dirs]),
                    EventLog(os.path.join(node_dirs[0], "events"), "chaos"), storage, topo, job.spares, controller,
                    starter=join, etcd=etcd, decision_log=_DecisionTail(node_dirs) if etcd is not None else None,
                    endpoint=endpoint, token=base_env.get(auth.TOKEN_ENV))
        stacks: dict[int, tuple[str, str]] = {}
        try:
            timed_out, errors = _watch(live, list(actions), start + job.timeout_s)
            if timed_out:  # where each process is stuck, while it still is
                stacks = dump_stacks(tagged_pids(f"{TAG_ENV}={tag}"), log_dir)
        finally:
            live.log.close()
            orphans = _reap(agents + ([controller] if controller else []), tag)
        wall = time.monotonic() - start
    with open(os.path.join(log_dir, "job.out")) as f:
        output = f.read()
    events = [e for d in node_dirs for e in read_events(os.path.join(d, "events"))]  # a joined node's too
    events.sort(key=lambda e: e["t"])
    decisions = read_decisions(node_dirs)
    if live.decision_log is not None:
        live.decision_log.poll()  # the last decisions, for outcome_agent
    # the job's outcome is the controller's: node 0's agent's (another node may be lost on purpose), or
    # with etcd the last elected leader's (node 0's agent may be the one a fault killed)
    code = live.outcome_agent().returncode if not timed_out else 124
    return JobRun(RunResult(code, wall, events, output), timed_out, orphans, errors,
                  [a.returncode for a in agents], [a.pid for a in agents], decisions, job.store, stacks)


def _start_etcd(stack: contextlib.ExitStack, host: str, log_dir: str) -> Any:
    """The run's private etcd on ``host``, stopped (its log copied into ``log_dir``) when ``stack``
    closes, however the run ends."""
    from hp.core.etcd_store import EtcdServer

    # die_with_parent: a SIGKILLed runner leaves no etcd behind (it lives no longer than this call)
    server = EtcdServer(host, workdir=log_dir, die_with_parent=True)

    def stop() -> None:
        with contextlib.suppress(OSError):
            shutil.copyfile(server.log_path, os.path.join(log_dir, "etcd.log"))
        server.stop()

    stack.callback(stop)
    server.start()  # stops (and cleans up) by itself if it fails
    return server


def _watch(live: Live, actions: list[Action], deadline: float) -> tuple[bool, list[str]]:
    """Poll events and fire due actions until every agent has exited; undo what is still active."""
    pending, undos, errors = list(actions), [], []  # undos: (due time, fn)
    try:
        while any(a.poll() is None for a in live.agents):
            if time.monotonic() > deadline:
                return True, errors
            live.update()
            for action in list(pending):
                try:
                    if action.ready(live):
                        pending.remove(action)
                        undo = action.fire(live)
                        if undo is not None:
                            due = time.monotonic() + action.duration_s if action.duration_s else float("inf")
                            undos.append((due, undo))
                except Exception as e:  # a fault that cannot be applied is a result, not a crash
                    if action in pending:  # ready() raised (fire() is called once removed)
                        pending.remove(action)
                    errors.append(f"{type(action).__name__}: {type(e).__name__}: {e}")
            for item in [u for u in undos if u[0] <= time.monotonic()]:
                undos.remove(item)
                _safely(item[1], errors)
            time.sleep(POLL_S)
        live.update()
        return False, errors
    finally:
        for _, undo in undos:
            _safely(undo, errors)


def _safely(fn: Callable[[], None], errors: list[str]) -> None:
    try:
        fn()
    except Exception as e:
        errors.append(f"undo: {type(e).__name__}: {e}")


def _reap(agents: list[subprocess.Popen], tag: str) -> int:
    """Kill the agents' process groups, then any process of this run still alive (workers and
    spares live in sessions of their own); returns how many of those were found."""
    for a in agents:
        if a.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
        a.wait()
    deadline = time.monotonic() + 3.0  # let orphans of a dead agent notice on their own first
    while tagged_pids(f"{TAG_ENV}={tag}") and time.monotonic() < deadline:
        time.sleep(0.1)
    left = len(tagged_pids(f"{TAG_ENV}={tag}"))
    kill_tagged(f"{TAG_ENV}={tag}")
    return left

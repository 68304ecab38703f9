"""The baseline of ``hp bench elastic``: torchrun's elastic rendezvous + DCP checkpoint-restart.

Several ``torchrun`` agents ("nodes") on this host form one job through the ``c10d`` rendezvous
(``--nnodes MIN:MAX``); each runs ``--nproc-per-node`` workers of
:mod:`hp.chaos.baselines.train_elastic_torchrun` (the demo model, plain DDP on gloo, AdamW, a
constant global batch, DCP checkpoints). :func:`run_baseline` drives the job through the scale
events of the hp demo, at given steps, and measures each event from the workers' commit logs.

What each event is, and what torchrun does with it (torch 2.13, read from
``torch/distributed/elastic`` and checked here):

``kill``
    SIGKILL of one worker (global rank ``kill_rank``). Its agent sees the exit code (within
    ``monitor_interval``) and, while restarts are left, stops its other workers and re-enters the
    rendezvous; the other workers' next gloo collective fails ("Connection closed by peer") and
    their agents do the same (or notice the waiting node first and restart for a membership change).
    Every worker of every agent is a new process: re-import torch, re-form the process group at the
    **same** world size (torchrun cannot shrink in process; nothing is spare), load the newest
    complete checkpoint, recompute the steps since it (``lost_steps``).
``grow``
    One more agent starts. It finds the current round complete and puts itself on the wait list;
    every running agent sees ``num_nodes_waiting() > 0`` at its next monitor tick and restarts its
    workers (SIGTERM; a membership change does not count against ``--max-restarts``, but a worker
    that exits first, after its graceful save, is a failure that does). The old
    workers train until then: the new agent's own start-up (import torch, ~3-5 s here) is not part
    of the pause. World size grows by ``nproc_per_node``.
``preempt``
    SIGTERM to one agent (a node being preempted): it forwards SIGTERM to its workers, waits for
    them, and exits **without** closing the rendezvous (``launch_agent`` skips
    ``rdzv_handler.shutdown()`` on a signal, which would end the whole job). The survivors' workers
    fail or stop and their agents re-enter the rendezvous, but the new round cannot start until the
    gone node's participant entry expires: it sent no goodbye, so the others drop it only when its
    keep-alive is ``keep_alive_interval * keep_alive_max_attempt`` seconds old. World size shrinks
    by ``nproc_per_node``. The preempted agent is never agent 0: it hosts the c10d store
    (``is_host=true``; on one host every agent would match the endpoint, so the others get
    ``is_host=false`` as they would on other machines) and its death ends every agent's
    rendezvous ("The connection to the C10d store has failed"). With ``share_agent_store`` it is
    not the group-rank-0 agent either (that one hosts the workers' store then).

With ``save_on_sigterm`` (default, see the training script) a SIGTERM'd worker finishes its step
and every rank saves a checkpoint of it before leaving, so ``grow`` and ``preempt`` lose no step;
``kill`` always loses the steps since the last periodic checkpoint.

Per event, from rank 0's ``commit`` lines (the ranks commit in lockstep) and the process start
times: **pause_s** = first commit of a worker started after the event − last commit of a worker
started before it − the median step time at the new world size (the first step after the
re-form is new work); **lost_steps** = steps committed before the event and committed again
after it; **downtime_s** = back at the step the job had reached (the pause plus the recomputation)
− one step; **world_before/after**; **rounds**: how many times rank 0 was restarted before the job
settled (1 when the re-form went straight; more when a round formed without a node and had to
re-form again). ``phases`` splits the first restart like ``hp bench recovery`` does.

Rendezvous settings (``--rdzv-conf``), chosen to make membership changes as fast as torchrun
allows on one host without breaking it: ``last_call_timeout`` (default 30 s: the wait for more
nodes once ``MIN`` have joined; a round at ``MAX`` completes at once) 1 s; ``keep_alive_interval``
1 s × ``keep_alive_max_attempt`` 5 (default 5 s × 3). Fewer attempts broke the job here: a node
renews its keep-alive only when it is at least one interval old, so with 1 s × 2 live agents were
declared dead every few seconds and the job split into two independent world-1 jobs writing the
same checkpoint directory. ``MIN`` defaults to the fewest nodes the plan reaches (with the default
plan, the initial count: the first round waits for every initial node), ``MAX`` to the most.
``OMP_NUM_THREADS=1``, as torchrun sets it for several workers per host but not for one worker
per agent: two single-worker agents on 2 cores without it took 2.7 s for the first step and
0.32 s per step, against 0.07 s and 0.05 s with it.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``share_agent_store=False``): with torch's default, the
group-rank-0 agent hosts one TCPStore for its workers for the agent's whole life and publishes its
address only in the first round it is rank 0 of (``DynamicRendezvousHandler.next_rendezvous``
caches ``_bootstrap_store_info``). A node that joins later waits for that address under the new
round's key prefix, which nobody writes: every ``grow`` hung here until the 60 s store timeout
and then the whole job died. With sharing off, rank 0 publishes a fresh port every round and
global rank 0 hosts a fresh worker store (no stale keys from the last round either): torch's own
opt-out, the one the reporters of pytorch#135712 used against stale store keys after restarts.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from hp.chaos.baselines import train_elastic_torchrun as train
from hp.chaos.bench.recovery_common import median_step, phases
from hp.checkpointless.demo.workload import workload_argv
from hp.core.procs import free_port, kill_tagged

EVENT_KINDS = ("kill", "grow", "preempt")
TAG_VAR = "HP_ELASTIC_BASELINE_RUN"  # in every agent's and worker's environment: what cleanup kills
DEFAULT_EVENTS = "kill@12,grow@+10,preempt@+10,grow@+10"


@dataclass(frozen=True)
class ScaleEvent:
    kind: str  # kill | grow | preempt
    at_step: int
    relative: bool = False  # at_step counts from the previous event's first commit after it

    def due(self, resumed_step: int) -> int:
        """The step whose commit fires this event, given the step the previous event resumed at."""
        return resumed_step + self.at_step if self.relative else self.at_step


def parse_events(spec: str) -> tuple[ScaleEvent, ...]:
    """``"kill@10,grow@+15"`` -> events. ``KIND@N`` fires once rank 0 committed step N or later;
    ``KIND@+N`` N steps after the step at which the job resumed from the previous event, which
    keeps a plan valid however many steps a re-form takes (a grow lets the old world train on
    while the new node starts, tens of steps here). Every event waits for the previous one's resume."""
    events = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, step = part.partition("@")
        relative = step.startswith("+")
        if kind not in EVENT_KINDS or not step.lstrip("+").isdigit() or (relative and not events):
            raise ValueError(f"bad event {part!r}: expected KIND@STEP or (after the first) KIND@+STEPS, "
                             f"KIND in {EVENT_KINDS}")
        events.append(ScaleEvent(kind, int(step.lstrip("+")), relative))
    absolute = [e.at_step for e in events if not e.relative]
    if any(b <= a for a, b in zip(absolute, absolute[1:])):
        raise ValueError(f"absolute event steps must increase: {spec!r}")
    return tuple(events)


@dataclass
class ElasticBaselineConfig:
    nodes: int = 2  # torchrun agents at the start
    nproc_per_node: int = 1
    events: str = DEFAULT_EVENTS  # KIND@STEP or KIND@+STEPS, comma-separated (see parse_events)
    steps: int = 200  # enough for the plan: each grow lets the old world train ~50 steps while the node starts
    global_batch: int = 24  # samples per step at every world size
    micro_batch: int = 4  # global_batch / micro_batch micro-batches, split over the ranks
    ckpt_every: int = 5
    save_on_sigterm: bool = True
    kill_rank: int = 1  # the worker a kill event SIGKILLs (global rank)
    model_size: str = "tiny"
    vocab: int = 256
    seq: int = 64
    corpus_mb: int = 16
    seed: int = 0
    min_nodes: int | None = None  # None: the fewest nodes the plan reaches
    max_nodes: int | None = None  # None: the most
    max_restarts: int = 20  # per agent; a failure on any node costs every agent one
    monitor_interval: float = 0.1
    last_call_timeout: int = 1  # rdzv-conf values are whole seconds
    keep_alive_interval: int = 1
    keep_alive_max_attempt: int = 5
    join_timeout: int = 120
    close_timeout: int = 10
    preempt_grace_s: float = 30.0  # a preempted agent still alive after this is SIGKILLed (as k8s does)
    share_agent_store: bool = False  # torch's default (True) hangs every grow: see the module docstring
    log_dir: str | None = None
    timeout_s: float = 300.0  # the whole run: a hang guard, not a measurement
    event_timeout_s: float = 120.0  # one event to the job's first commit after it

    @property
    def plan(self) -> tuple[ScaleEvent, ...]:
        return parse_events(self.events)

    def node_counts(self) -> list[int]:
        """Nodes alive at the start and after each event."""
        counts = [self.nodes]
        for ev in self.plan:
            counts.append(counts[-1] + {"kill": 0, "grow": 1, "preempt": -1}[ev.kind])
        return counts

    @property
    def nnodes(self) -> tuple[int, int]:
        counts = self.node_counts()
        return (self.min_nodes or min(counts), self.max_nodes or max(counts))

    def validate(self) -> None:
        counts, (lo, hi) = self.node_counts(), self.nnodes
        m_total = self.global_batch // self.micro_batch
        problems = [
            self.nodes < 1 and "nodes must be >= 1",
            self.nproc_per_node < 1 and "nproc_per_node must be >= 1",
            self.global_batch % self.micro_batch and f"micro_batch {self.micro_batch} must divide "
                                                     f"global_batch {self.global_batch}",
            min(counts) < 1 and f"the plan leaves no node ({counts})",
            max(counts) * self.nproc_per_node > m_total and f"world {max(counts) * self.nproc_per_node} > "
                                                            f"{m_total} micro-batches: some rank would idle",
            not 1 <= lo <= min(counts) and f"min_nodes {lo} must be in [1, {min(counts)}]",
            hi < max(counts) and f"max_nodes {hi} < {max(counts)} nodes the plan reaches",
            self.ckpt_every < 1 and "ckpt_every must be >= 1",
            any(e.at_step >= self.steps for e in self.plan) and f"every event step must be < steps ({self.steps})",
            self.preempt_grace_s <= 0 and "preempt_grace_s must be > 0",
            any(e.kind == "preempt" and counts[i] < 2 for i, e in enumerate(self.plan))
            and "a preempt needs a node besides agent 0 (the c10d store host)",
            not 0 <= self.kill_rank < min(counts) * self.nproc_per_node and f"kill_rank {self.kill_rank} "
                                                                           "is not a rank at every world size",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("; ".join(problems))

    def train_args(self, log_dir: str) -> list[str]:
        return ["--steps", str(self.steps), "--global-batch", str(self.global_batch),
                "--micro-batch", str(self.micro_batch), "--ckpt-every", str(self.ckpt_every),
                "--save-on-sigterm" if self.save_on_sigterm else "--no-save-on-sigterm",
                *workload_argv(self, "model_size", "vocab", "seq", "corpus_mb", "seed"), "--log-dir", log_dir]


def _log(msg: str) -> None:
    print(f"elastic baseline: {msg}", file=sys.stderr, flush=True)


class _Logs:
    """Incremental reader of the workers' JSON-lines logs (complete lines only, any number of files)."""

    def __init__(self, directory: str) -> None:
        self.directory, self._offsets, self.events = directory, {}, []
        self.started: dict[int, float] = {}  # worker pid -> process start (wall clock)
        self.commits: list[dict] = []  # rank 0's, in the order read

    def poll(self) -> list[dict]:
        new: list[dict] = []
        names = sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []
        for name in names:
            path = os.path.join(self.directory, name)
            with open(path, "rb") as f:
                f.seek(self._offsets.get(name, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[name] = self._offsets.get(name, 0) + end
            new += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        for e in new:
            if e["event"] == "started":
                self.started[e["pid"]] = e["at"]
            elif e["event"] == "commit" and e["rank"] == 0:
                self.commits.append(e)
        self.events += new
        return new


@dataclass
class _Agent:
    index: int
    proc: subprocess.Popen
    started_t: float
    log_path: str
    preempted_t: float | None = None


@dataclass
class _Job:
    cfg: ElasticBaselineConfig
    root: str
    run_id: str
    port: int
    agents: list[_Agent] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": os.environ.get("LOGLEVEL", "INFO"),
               TAG_VAR: self.run_id}
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0" if self.cfg.share_agent_store else "1"
        return env

    def command(self, is_host: bool) -> list[str]:
        cfg, (lo, hi) = self.cfg, self.cfg.nnodes
        conf = (f"is_host={'true' if is_host else 'false'},join_timeout={cfg.join_timeout},"
                f"last_call_timeout={cfg.last_call_timeout},close_timeout={cfg.close_timeout},"
                f"keep_alive_interval={cfg.keep_alive_interval},keep_alive_max_attempt={cfg.keep_alive_max_attempt}")
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{lo}:{hi}",
                "--nproc-per-node", str(cfg.nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id, "--rdzv-conf", conf,
                "--local-addr", "127.0.0.1", "--max-restarts", str(cfg.max_restarts),
                "--monitor-interval", str(cfg.monitor_interval),
                "-m", train.MODULE, *cfg.train_args(self.root)]

    def start_agent(self) -> _Agent:
        index = len(self.agents)
        log_path = os.path.join(self.root, f"agent{index}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(self.command(is_host=index == 0), env=self.env(), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        agent = _Agent(index, proc, time.time(), log_path)
        self.agents.append(agent)
        return agent

    def alive(self) -> list[_Agent]:
        return [a for a in self.agents if a.proc.poll() is None]

    def enforce_grace(self) -> None:
        """SIGKILL a preempted agent that outlived its grace period (one blocked in a store read
        handles no signal until the read returns: seen here after a failed round)."""
        for a in self.agents:
            if a.preempted_t is not None and a.proc.poll() is None \
                    and time.time() - a.preempted_t > self.cfg.preempt_grace_s:
                _log(f"agent {a.index} ignored SIGTERM for {self.cfg.preempt_grace_s} s: SIGKILL")
                os.killpg(a.proc.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        """SIGKILL every agent's process group, then every process carrying this run's tag (the
        workers run in sessions of their own, and an orphaned one keeps nothing else alive)."""
        for a in self.agents:
            if a.proc.poll() is None:
                try:
                    os.killpg(a.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        kill_tagged(f"{TAG_VAR}={self.run_id}")
        for a in self.agents:
            try:
                a.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


class _Failed(Exception):
    pass


def _wait(logs: _Logs, job: _Job, until: float, what: str, predicate) -> dict:
    """Poll the logs until ``predicate(commit)`` holds for one of rank 0's new commits; returns it."""
    seen = len(logs.commits)
    while True:
        gone = not job.alive()  # read before the logs: a job that ended has written its last line
        logs.poll()
        hit = next((c for c in logs.commits[seen:] if predicate(c)), None)
        if hit is not None:
            return hit
        seen = len(logs.commits)
        job.enforce_grace()
        if gone:
            raise _Failed(f"every agent exited while waiting for {what}" + (
                " (the job reached its last step first: raise steps)" if any(
                    e["event"] == "finished" for e in logs.events) else ""))
        if time.monotonic() > until:
            raise _Failed(f"timed out waiting for {what}")
        time.sleep(0.02)


def _current(logs: _Logs) -> list[dict]:
    """The newest commit line of every rank in the newest incarnation (rank -> line)."""
    latest: dict[int, dict] = {}
    for e in logs.events:
        if e["event"] == "commit":
            latest[e["rank"]] = e
    if not latest:
        return []
    world = latest[0]["world"] if 0 in latest else max(e["world"] for e in latest.values())
    return [e for e in latest.values() if e["world"] == world]


def _fire(job: _Job, logs: _Logs, ev: ScaleEvent) -> dict[str, Any]:
    """Do ``ev`` now; returns what was done to whom (with the wall-clock time it was done)."""
    current = _current(logs)
    if ev.kind == "kill":
        target = next((e for e in current if e["rank"] == job.cfg.kill_rank), None)
        if target is None:
            raise _Failed(f"no worker of rank {job.cfg.kill_rank} in the current world")
        t = time.time()
        try:
            os.kill(target["pid"], signal.SIGKILL)
        except ProcessLookupError:
            raise _Failed(f"rank {target['rank']} (pid {target['pid']}) was gone before the kill") from None
        return {"t": t, "kind": ev.kind, "pid": target["pid"], "rank": target["rank"]}
    if ev.kind == "grow":
        t = time.time()
        agent = job.start_agent()
        return {"t": t, "kind": ev.kind, "agent": agent.index, "agent_pid": agent.proc.pid}
    # preempt: an agent that hosts neither the c10d store (agent 0) nor the workers' store (group rank 0)
    group0 = {e["agent_pid"] for e in current if e["group_rank"] == 0}
    candidates = [a for a in job.alive() if a.index != 0 and a.proc.pid not in group0]
    if not candidates:
        raise _Failed("no agent to preempt besides the store hosts")
    agent = candidates[0]
    t = time.time()
    agent.proc.send_signal(signal.SIGTERM)
    agent.preempted_t = t
    return {"t": t, "kind": ev.kind, "agent": agent.index, "agent_pid": agent.proc.pid}


def run_baseline(cfg: ElasticBaselineConfig) -> dict[str, Any]:
    """Run the torchrun job through ``cfg.events``; the per-event pauses and their medians (see the
    module docstring). Never raises for a job that fails: ``completed`` is False and ``error`` says why."""
    cfg.validate()
    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_elastic_baseline_")
    os.makedirs(root, exist_ok=True)
    run_id = f"hp-elastic-{uuid.uuid4().hex[:12]}"
    job = _Job(cfg, root, run_id, free_port())
    logs = _Logs(os.path.join(root, "events"))
    fired: list[dict[str, Any]] = []
    error, start = None, time.monotonic()
    deadline = start + cfg.timeout_s
    _warm_cache(cfg)
    rcs: dict[int, int | None] = {}
    try:
        for _ in range(cfg.nodes):
            job.start_agent()
        resumed_t, resumed_step = 0.0, 0
        for i, ev in enumerate(cfg.plan):
            due = ev.due(resumed_step)
            if due >= cfg.steps:
                raise _Failed(f"event {i} ({ev.kind}) is due at step {due}, past the last step: raise steps")
            _wait(logs, job, deadline, f"step {due} before event {i} ({ev.kind})",
                  lambda c, due=due, after=resumed_t: c["step"] >= due and c["t"] > after)
            done = _fire(job, logs, ev)
            _log(f"event {i}: {ev.kind} at step >= {due}: {done}")
            fired.append({**done, "at_step": due})
            first = _wait(logs, job, min(deadline, time.monotonic() + cfg.event_timeout_s),
                          f"the first commit after event {i} ({ev.kind})",
                          lambda c, t=done["t"]: logs.started.get(c["pid"], 0.0) > t)
            resumed_t, resumed_step = first["t"], first["step"]
        while job.alive():  # the job ends by itself: wait for every agent
            if time.monotonic() > deadline:
                raise _Failed(f"agents {[a.index for a in job.alive()]} did not exit within the run's timeout")
            job.enforce_grace()
            time.sleep(0.1)
    except _Failed as e:
        error = str(e)
    finally:
        rcs = {a.index: a.proc.poll() for a in job.agents}
        job.stop_all()
        logs.poll()
    with open(os.path.join(root, "harness.jsonl"), "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in fired)
    result = analyse(logs.events, fired, cfg.steps, cfg.nproc_per_node)
    preempted = {a.index for a in job.agents if a.preempted_t is not None}
    finished = any(e["event"] == "finished" for e in logs.events)
    completed = (error is None and finished and len(fired) == len(cfg.plan)
                 and all(rc == 0 for i, rc in rcs.items() if i not in preempted))
    out = {
        "variant": "torchrun_elastic_dcp", "completed": completed, **result,
        "agents": [{"index": a.index, "returncode": rcs[a.index], "preempted": a.index in preempted}
                   for a in job.agents],
        "nnodes": list(cfg.nnodes), "config": asdict(cfg), "log_dir": root, "run_id": run_id,
        "wall_s": time.monotonic() - start,
        "checkpoint": "dcp.save, synchronous, every ckpt_every steps" +
                      (" and at a SIGTERM (graceful stop at the step's end)" if cfg.save_on_sigterm else ""),
        "pause_definition": "first commit of a worker started after the event - last commit of a worker "
                            "started before it - median step time at the new world size (rank 0)",
    }
    if not completed:
        out["error"] = error or ("job did not finish" if not finished else f"agent exit codes {rcs}")
        out["error_tail"] = {f"agent{a.index}": _tail(a.log_path) for a in job.agents}
    return out


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _warm_cache(cfg: ElasticBaselineConfig) -> None:
    """Build the token cache before the job: preprocessing is no part of any pause."""
    from hp.checkpointless.data import TokenCache, synthetic_corpus, tokenize

    key = train.corpus_key(cfg.corpus_mb, cfg.vocab, cfg.seed)
    TokenCache.open(key, lambda: tokenize(synthetic_corpus(cfg.corpus_mb << 20, cfg.seed), cfg.vocab)).close()


# ---------------------------------------------------------------- analysis (pure: logs in, numbers out)
def step_times(commits: list[dict]) -> dict[int, float]:
    """World size -> median interval between consecutive commits of one rank-0 process (a restart's
    first step, which pays the warm-up, is never an interval)."""
    by_pid: dict[int, list[dict]] = {}
    for c in commits:
        by_pid.setdefault(c["pid"], []).append(c)
    per_world: dict[int, list[float]] = {}
    for cs in by_pid.values():
        cs = sorted(cs, key=lambda c: c["t"])
        for a, b in zip(cs, cs[1:]):
            per_world.setdefault(b["world"], []).append(b["t"] - a["t"])
    return {w: statistics.median(v) for w, v in per_world.items()}


def analyse(events: list[dict], fired: list[dict], steps: int, nproc_per_node: int = 1) -> dict[str, Any]:
    """Per-event pause, lost steps and world sizes, from the workers' logs and the harness's record
    of what it did when (``fired``: ``t``, ``kind``); medians over the events."""
    commits = sorted((e for e in events if e["event"] == "commit" and e["rank"] == 0), key=lambda e: e["t"])
    started = {e["pid"]: e["at"] for e in events if e["event"] == "started"}
    by_pid: dict[int, list[dict]] = {}
    for e in events:
        by_pid.setdefault(e["pid"], []).append(e)
    per_world = step_times(commits)
    overall = median_step([c["t"] for c in commits]) if len(commits) > 1 else None
    out_events = []
    for i, ev in enumerate(fired):
        t0, t_next = ev["t"], fired[i + 1]["t"] if i + 1 < len(fired) else float("inf")
        old = [c for c in commits if started.get(c["pid"], 0.0) <= t0]
        new = [c for c in commits if t0 < started.get(c["pid"], 0.0) < t_next]
        row: dict[str, Any] = {"kind": ev["kind"], "at_step": ev.get("at_step"), "t": t0,
                               "target": {k: ev[k] for k in ("pid", "rank", "agent", "agent_pid") if k in ev}}
        if not old or not new:
            out_events.append({**row, "error": "no commit before the event" if not old else "no commit after it"})
            continue
        last, first = old[-1], new[0]
        step_s = per_world.get(first["world"], overall)
        back = next((c for c in new if c["step"] == last["step"] + 1), None)
        rank0 = sorted(by_pid.get(first["pid"], []), key=lambda e: e["t"])
        marks = {"detect_teardown": started[first["pid"]] - last["t"]}
        for name, event in (("import", "imported"), ("pg_init", "pg_ready"), ("model_build", "model_ready"),
                            ("dcp_load", "restored")):
            hit = next((e["t"] for e in rank0 if e["event"] == event), None)
            marks[name] = None if hit is None else hit - last["t"]
        marks["first_step"] = first["t"] - last["t"]
        restored = next((e for e in rank0 if e["event"] == "restored"), {})
        expected = last["world"] + {"kill": 0, "grow": nproc_per_node, "preempt": -nproc_per_node}[ev["kind"]]
        settled = new[-1]["world"]
        row.update({
            "step_before": last["step"], "first_step_after": first["step"],
            "restored_step": restored.get("step"),
            "last_commit_before_s": last["t"] - t0, "first_commit_after_s": first["t"] - t0,
            "step_time_s": step_s,
            "pause_s": None if step_s is None else first["t"] - last["t"] - step_s,
            "lost_steps": max(0, last["step"] - first["step"] + 1),
            "downtime_s": None if back is None or step_s is None else back["t"] - last["t"] - step_s,
            "world_before": last["world"], "world_after": first["world"], "world_settled": settled,
            "world_expected": expected, "world_as_expected": settled == expected,
            "rounds": len({c["pid"] for c in new}),
            "phases": phases(marks),
        })
        out_events.append(row)

    def med(key: str, rows: list[dict]) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    kinds = sorted({r["kind"] for r in out_events})
    saves = [e["duration_s"] for e in events if e["event"] == "checkpoint_saved" and e["rank"] == 0]
    final = max((c["step"] for c in commits), default=None)
    return {
        "events": out_events,
        "median": {k: med(k, out_events) for k in ("pause_s", "lost_steps", "downtime_s")},
        "median_by_kind": {kind: {k: med(k, [r for r in out_events if r["kind"] == kind])
                                  for k in ("pause_s", "lost_steps", "downtime_s")} for kind in kinds},
        "step_time_s": {str(w): s for w, s in sorted(per_world.items())},
        "ckpt_save_s": statistics.median(saves) if saves else None,
        "sigterm_saves": sum(1 for e in events if e["event"] == "checkpoint_saved" and e["rank"] == 0
                             and e.get("why") == "sigterm"),
        "final_step": final, "reached_end": final == steps - 1,
        "worker_failures": sum(1 for e in events if e["event"] == "failure_detected"),
    }


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def format_table(r: dict[str, Any]) -> str:
    cfg = r["config"]
    lines = [f"torchrun --nnodes {r['nnodes'][0]}:{r['nnodes'][1]} (c10d) + DCP every {cfg['ckpt_every']} steps: "
             f"{cfg['nodes']} nodes x {cfg['nproc_per_node']} workers, model {cfg['model_size']}, "
             f"{cfg['steps']} steps, global batch {cfg['global_batch']}; "
             f"completed: {'yes' if r['completed'] else 'NO'}"]
    rows = [("event", "at step", "world", "pause", "lost steps", "downtime", "rounds")]
    for e in r["events"]:
        if "error" in e:
            rows.append((e["kind"], str(e.get("at_step")), "-", e["error"], "", "", ""))
            continue
        rows.append((e["kind"], str(e["step_before"]), f"{e['world_before']} -> {e['world_settled']}",
                     _s(e["pause_s"]), str(e["lost_steps"]), _s(e["downtime_s"]), str(e["rounds"])))
    m = r["median"]
    rows.append(("median", "", "", _s(m["pause_s"]), "-" if m["lost_steps"] is None else f"{m['lost_steps']:g}",
                 _s(m["downtime_s"]), ""))
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, width)).rstrip() for row in rows]
    lines.append("step time by world size: " + ", ".join(f"W={w} {s:.3f} s" for w, s in r["step_time_s"].items()))
    lines.append(f"logs: {r['log_dir']}")
    if r.get("error"):
        lines.append(f"error: {r['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m hp.chaos.baselines.elastic_torchrun [--json] [--FIELD VALUE ...]`` (any config field)."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    defaults = ElasticBaselineConfig()
    for name, value in asdict(defaults).items():
        kind = {bool: lambda s: s.lower() in ("1", "true", "yes"), int: int, float: float}.get(type(value), str)
        if value is None:  # the optional ones: min_nodes, max_nodes (ints), log_dir
            kind = str if name == "log_dir" else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    args = vars(p.parse_args(argv))
    as_json = args.pop("json")
    result = run_baseline(ElasticBaselineConfig(**args))
    print(format_table(result), flush=True)
    if as_json:
        print(json.dumps(result), flush=True)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""An elastic hp job following a real Slurm (:class:`hp.chaos.clusters.slurm.LocalSlurm`) through its scale events.

The job is ``hp slurm submit`` (:mod:`hp.core.schedulers.slurm.job`) of the elastic demo (exact mode, a constant
global batch): a base of ``min_nodes`` in partition ``high`` and one scaling unit per node above it in
partition ``low``, one rank per node. Nothing here signals a process: Slurm does, and the run follows
what Slurm decides.

1. **grow**: another tenant's high-priority job holds the unit nodes when the job starts, so the units
   wait in the queue; once the job has trained ``hold_steps`` steps at ``min_nodes`` the tenant's job is
   cancelled, the units start and join (``min`` → ``max``);
2. **preemption** (``cycles`` times): a high-priority job of ``max - min`` nodes is submitted; Slurm
   preempts the units (SIGTERM, ``GraceTime``), their ranks leave at a step boundary (``max`` → ``min``),
   the base submits them again; the high job ends after ``high_s`` and they grow the job back to ``max``;
3. **node DOWN** (``node_down``): the node of the last unit is set DOWN (``scontrol update``): Slurm ends
   its job and hp shrinks (``max`` → ``max - 1``); its new unit waits for a node that never comes back.

With ``quota`` set, the cluster enforces QOS limits instead (MariaDB + slurmdbd,
:mod:`hp.chaos.clusters.slurm_accounting`) and the job runs under a QOS that lets one user hold ``quota`` nodes:
it grows only to ``quota`` (the last unit pends, ``QOSMaxNodePerUserLimit``) and :meth:`capacity` says so;
the quota is raised to ``max`` and the job grows into it (``quota`` → ``max``).

With ``base_down`` set, the cluster has one node more than ``max``: once the job runs at ``max``, the
node of base node rank 1 is set DOWN instead. The base job (``--no-kill``) goes on without it: its ranks
are lost (``max`` → ``max - 1``) and a replacement job for that node rank starts on the free node and
joins (back to ``max``).

Then, ``finish_after`` steps at the final size after the last event, the run asks the job to end
(``hp finish``: every rank ends after the same step, agreed in a commit vote); ``steps`` is the most it
may run. Its per-step losses and every rank's final state are compared, bit for bit, with a fixed-size
run at the final size to the same step (:func:`hp.elastic.demo.run.reference_run`, run afterwards: the
demo's training has no schedule tied to ``--steps``).
``shrink_s``: the preemption notice (the controller's ``preempt`` decision: the unit's agent asks to
leave when Slurm's SIGTERM arrives) → the first commit at the smaller size; ``grow_s``: capacity back
(the high job's last instant, written by the job itself) → the first commit at ``max`` again.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from hp.chaos.clusters.slurm import LocalSlurm
from hp.core.schedulers.slurm.backend import SlurmCli
from hp.core.schedulers.slurm.job import SlurmJobSpec, submit
from hp.core.procs import free_port

if TYPE_CHECKING:
    from hp.chaos.references import ReferenceCache

POLL_S = 0.2
QOS = "hpquota"


@dataclass
class SlurmElasticConfig:
    steps: int = 400  # the most the job may run (it ends `finish_after` steps after the last event)
    finish_after: int = 5  # 0: run to `steps`
    min_nodes: int = 2
    max_nodes: int = 4
    global_batch: int = 48
    micro_batch: int = 4
    model_size: str = "tiny"
    corpus_mb: int = 16
    seed: int = 0
    exact: bool = True
    hold_steps: int = 10  # steps at a size before the next event
    cycles: int = 1  # preemptions (each followed by capacity coming back)
    high_s: float = 2.0  # how long the preempting job runs
    node_down: bool = True
    quota: int | None = None  # the QOS scenario instead of the tenant/preemption/DOWN one (see above)
    base_down: bool = False  # the base-node-failure scenario instead (see above)
    grace_s: int = 10  # the unit partition's GraceTime (hp run --grace-period: 1.5 s less)
    reference: bool = True
    log_dir: str | None = None
    timeout_s: float = 480.0


class _Failed(Exception):
    pass


class _Run:
    """The job on the local Slurm, and what its logs say."""

    def __init__(self, cfg: SlurmElasticConfig, slurm: LocalSlurm, root: str, policy: str, train: list[str]) -> None:
        self.cfg, self.slurm, self.root = cfg, slurm, root
        self.cli = SlurmCli({**slurm.env, "OMP_NUM_THREADS": "1"})  # exported to every job: exact mode
        self.spec = SlurmJobSpec(
            entrypoint=train, job_dir=os.path.join(root, "job"), min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes,
            scaling_policy=policy, base_partition="high", unit_partition="low", port=free_port(),
            run_id=f"slurm{os.getpid()}", grace_period_s=max(1.0, cfg.grace_s - 1.5),
            run_flags=["--tee", "0", "--monitor-interval", "0.05"],
            sbatch_options=[f"--qos={QOS}"] if cfg.quota else [])
        self.token = os.urandom(16).hex()
        self.deadline = time.monotonic() + cfg.timeout_s
        self.marks: list[dict] = []  # what this run did, when (wall clock)

    def events(self) -> list[dict]:
        from hp.checkpointless.events import read_events

        return [e for d in glob.glob(os.path.join(self.spec.job_dir, "node*")) for e in read_events(os.path.join(d, "events"))]

    def decisions(self) -> list[dict]:
        out = []
        for path in glob.glob(os.path.join(self.spec.job_dir, "node0-*", "controller_decisions.jsonl")):
            with open(path) as f:
                out += [json.loads(line) for line in f if line.strip()]
        return sorted(out, key=lambda d: d["t"])

    def commits(self) -> list[tuple[float, int, int]]:
        """(time, step, world) of each step's last commit, by step."""
        from hp.elastic.demo.run import commits

        return sorted((max(e["t"] for e in es), step, max(e["world"] for e in es)) for step, es in commits(self.events()).items())

    def wait(self, what: str, done: Callable[[list[tuple[float, int, int]]], bool]) -> None:
        while time.monotonic() < self.deadline:
            if self.base_state() not in (None, "PENDING", "RUNNING", "CONFIGURING"):
                raise _Failed(f"the job ended ({self.base_state()}) while waiting for {what}")
            if done(self.commits()):
                return
            time.sleep(POLL_S)
        raise _Failed(f"timed out waiting for {what}")

    def held(self, world: int, since: float) -> Callable[[list[tuple[float, int, int]]], bool]:
        """Whether the job committed ``hold_steps`` steps at ``world`` after ``since``."""
        return lambda cs: sum(1 for t, _, w in cs if t > since and w == world) >= self.cfg.hold_steps

    def base_state(self) -> str | None:
        return next((j.state for j in self.cli.jobs([self.spec.job_name()])), None)

    def mark(self, kind: str, **extra: object) -> float:
        t = time.time()
        self.marks.append({"kind": kind, "t": t, **extra})
        return t

    def hold_nodes(self, nodes: int) -> str:
        """Another tenant's high-priority job on ``nodes`` nodes, until cancelled."""
        return self.cli.sbatch("#!/bin/bash\nexec sleep 3600\n", "-p", "high", "-N", str(nodes), "-J", "tenant",
                               f"--output={self.root}/tenant-%j.out")

    def preempt(self, cycle: int) -> str:
        """A high-priority job of the unit nodes' size that runs ``high_s`` and records its end."""
        end = os.path.join(self.root, f"high{cycle}.end")
        # written whole, then renamed: the run reads the file once it exists (it once read it empty)
        script = f"#!/bin/bash\nsleep {self.cfg.high_s:g}\ndate +%s.%N > {end}.tmp && mv {end}.tmp {end}\n"
        return self.cli.sbatch(script, "-p", "high", "-N", str(self.cfg.max_nodes - self.cfg.min_nodes), "-J",
                               f"high{cycle}", f"--output={self.root}/high{cycle}-%j.out")

    def capacity(self) -> dict:
        """What the job's scheduler backend says (its base and units held, its QOS quota), and why the
        units that wait do."""
        from hp.core.schedulers.slurm.backend import SlurmScheduler

        names = [self.spec.job_name(), *(self.spec.job_name(s) for s in self.spec.unit_slots)]
        cap = SlurmScheduler(self.slurm.env, job_names=tuple(names), qos=QOS).capacity("low")
        waiting = sorted(j.reason for j in self.cli.jobs(names) if j.state == "PENDING")
        return {"t": time.time(), "hosts": cap.hosts, "quota_hosts": cap.quota_hosts, "waiting": waiting}

    def drive_quota(self) -> None:
        """The QOS scenario (module docstring): grow to the quota, then into the raised quota."""
        from hp.chaos.clusters.slurm_accounting import set_qos

        cfg, quota = self.cfg, self.cfg.quota
        submit(self.spec, self.token, self.cli)
        self.mark("submitted")
        self.wait(f"{cfg.hold_steps} steps at the quota ({quota} nodes)", self.held(quota, 0.0))
        self.marks.append({"kind": "capacity_read", **self.capacity()})
        set_qos(self.cli, QOS, MaxTRESPerUser=f"node={cfg.max_nodes}")
        t = self.mark("capacity", how=f"the QOS quota raised to {cfg.max_nodes} nodes")
        self.wait(f"the job growing into the raised quota ({quota} -> {cfg.max_nodes})", self.held(cfg.max_nodes, t))
        self.marks.append({"kind": "capacity_read", **self.capacity()})
        self.finish(cfg.max_nodes, t)

    def drive_base_down(self) -> None:
        """The base-node-failure scenario (module docstring): lose base node 1, grow back on a replacement."""
        cfg, high = self.cfg, self.cfg.max_nodes
        submit(self.spec, self.token, self.cli)
        self.mark("submitted")
        self.wait(f"{cfg.hold_steps} steps at {high} nodes", self.held(high, 0.0))
        base = next(j for j in self.cli.jobs([self.spec.job_name()]) if j.state == "RUNNING")
        node = self.cli.hostnames(base.nodes)[1]
        self.cli.set_node_state(node, "DOWN", "hp-test")
        t = self.mark("base_node_down", node=node)
        self.wait(f"the shrink after base node {node} went DOWN", lambda cs: any(w < high for tt, _, w in cs if tt > t))
        t2 = self.mark("capacity", how="the replacement of the failed base node")
        self.wait(f"the replacement growing the job back to {high}", self.held(high, t2))
        self.finish(high, t2)

    def finish(self, world: int, since: float) -> None:
        """``finish_after`` steps at ``world`` after ``since``, ``hp finish`` (to the controller on the base's
        first node); then wait for the base job to end."""
        if self.cfg.finish_after:
            from hp.core.control_plane import request_finish
            from hp.core.errors import ControlPlaneError
            from hp.core.schedulers.slurm.job import head_endpoint

            self.wait(f"{self.cfg.finish_after} steps at {world} before finishing",
                      lambda cs: sum(1 for t, _, w in cs if t > since and w == world) >= self.cfg.finish_after)
            base = next((j for j in self.cli.jobs([self.spec.job_name()]) if j.state == "RUNNING"), None)
            if base is None:
                raise _Failed("the base job is not running: nothing to ask to finish")
            self.mark("finish")
            try:
                request_finish(head_endpoint(self.cli, base.nodes, self.spec.port), self.token,
                               "the Slurm elastic run saw its scale events")
            except ControlPlaneError as e:
                raise _Failed(f"hp finish was refused: {e}") from None
        while self.base_state() in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            if time.monotonic() > self.deadline:
                raise _Failed("the job did not finish in time")
            time.sleep(POLL_S)

    def unit_node(self, slot: int) -> str:
        running = [j for j in self.cli.jobs([self.spec.job_name(slot)]) if j.state == "RUNNING"]
        if not running:
            raise _Failed(f"unit {slot} is not running")
        return self.cli.hostnames(running[0].nodes)[0]

    def drive(self) -> None:
        cfg, low, high = self.cfg, self.cfg.min_nodes, self.cfg.max_nodes
        tenant = self.hold_nodes(high - low)
        submit(self.spec, self.token, self.cli)
        self.mark("submitted")
        self.wait(f"{cfg.hold_steps} steps at {low} nodes", self.held(low, 0.0))
        self.cli.scancel(tenant)
        t = self.mark("capacity", how="the tenant's job cancelled")
        self.wait(f"the units joining ({low} -> {high})", self.held(high, t))
        for cycle in range(cfg.cycles):
            t = self.mark("preemptor_submitted", cycle=cycle)  # before: Slurm may signal before sbatch returns
            self.preempt(cycle)
            self.wait(f"preemption {cycle} ({high} -> {low})", lambda cs, t=t: any(w == low for tt, _, w in cs if tt > t))
            shrunk = next(tt for tt, _, w in self.commits() if tt > t and w == low)
            end = os.path.join(self.root, f"high{cycle}.end")
            # a commit at the full size after the shrink (those between the preemptor's submission and the
            # shrink do not count)
            self.wait(f"capacity back after preemption {cycle}", lambda cs, end=end, shrunk=shrunk: os.path.exists(end)
                      and any(w == high for tt, _, w in cs if tt > shrunk))
            with open(end) as f:
                self.marks.append({"kind": "capacity", "t": float(f.read()), "how": f"high job {cycle} ended"})
            self.wait(f"{cfg.hold_steps} steps at {high} after preemption {cycle}", self.held(high, self.marks[-1]["t"]))
        if cfg.node_down:
            node = self.unit_node(high - 1)
            self.cli.set_node_state(node, "DOWN", "hp-test")
            t = self.mark("node_down", node=node)
            self.wait(f"the shrink after {node} went DOWN", lambda cs, t=t: any(w == high - 1 for tt, _, w in cs if tt > t))
            self.finish(high - 1, t)
        else:
            self.finish(high, self.marks[-1]["t"])


def timings(commits: list[tuple[float, int, int]], decisions: list[dict], marks: list[dict], low: int,
            high: int) -> dict[str, list[float]]:
    """``shrink_s`` per preemption (notice → first commit at ``low``) and ``grow_s`` per return of capacity
    (→ first commit at ``high``), from the commits (time, step, world), the decision log and the marks."""
    out: dict[str, list[float]] = {"shrink_s": [], "grow_s": []}
    for i, m in enumerate(marks):
        if m["kind"] == "preemptor_submitted":
            notice = next((d["t"] for d in decisions if d["decision"] == "preempt" and d["t"] > m["t"]), None)
            first = next((t for t, _, w in commits if notice is not None and t > notice and w == low), None)
            if first is not None:
                out["shrink_s"].append(round(first - notice, 3))
        elif m["kind"] == "capacity":
            first = next((t for t, _, w in commits if t > m["t"] and w == high), None)
            if first is not None:
                out["grow_s"].append(round(first - m["t"], 3))
    return out


def run_slurm_elastic(cfg: SlurmElasticConfig, cache: ReferenceCache | None = None) -> dict:
    """Run the job (and its fixed-size reference: ``cache``'s if it holds one of the same job); the
    comparison and the timings (never raises for a job that fails: ``completed`` is False and ``error``
    says why)."""
    from hp.checkpointless.demo.run import RunResult, compare_state
    from hp.checkpointless.events import finished_at
    from hp.elastic.demo.run import (POLICY, ElasticDemoConfig, commits, lost_steps, reference_run, scale_events,
                                     train_argv, world_by_step)

    root = cfg.log_dir or tempfile.mkdtemp(prefix="hp_slurm_elastic_")
    os.makedirs(root, exist_ok=True)
    policy = os.path.join(root, "policy.yaml")
    with open(policy, "w") as f:
        f.write(POLICY.format(min=cfg.min_nodes, max=cfg.max_nodes, global_batch=cfg.global_batch,
                              micro_batch=cfg.micro_batch))
    demo = ElasticDemoConfig(steps=cfg.steps, global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
                             model_size=cfg.model_size, exact=cfg.exact, corpus_mb=cfg.corpus_mb, seed=cfg.seed,
                             log_dir=root, timeout_s=cfg.timeout_s)
    final = cfg.max_nodes - (1 if cfg.node_down and not (cfg.quota or cfg.base_down) else 0)
    error, start = None, time.monotonic()
    with LocalSlurm(nodes=cfg.max_nodes + cfg.base_down, grace_s=cfg.grace_s, accounting=cfg.quota is not None) as slurm:
        run = _Run(cfg, slurm, root, policy, train_argv(demo, policy))
        try:
            if cfg.quota:
                from hp.chaos.clusters.slurm_accounting import set_qos

                set_qos(run.cli, QOS, MaxTRESPerUser=f"node={cfg.quota}")
                run.drive_quota()
            elif cfg.base_down:
                run.drive_base_down()
            else:
                run.drive()
        except _Failed as e:
            error = str(e)
        base_state = run.base_state()
        events = sorted(run.events(), key=lambda e: e["t"])
        decisions = run.decisions()
        units = {j.job_id: (j.name, j.state) for j in run.cli.jobs([run.spec.job_name(s) for s in range(1, cfg.max_nodes)])}
    wall = time.monotonic() - start
    worlds = world_by_step(events)
    steps = sorted(worlds)
    sequence = [worlds[s] for i, s in enumerate(steps) if i == 0 or worlds[s] != worlds[steps[i - 1]]]
    got_losses = {s: {e["loss"] for e in es} for s, es in commits(events).items()}
    # the step every rank ended after (hp finish, agreed in a commit vote), or the last one committed
    ended = finished_at(events)
    last = ended if ended is not None else max(steps, default=-1)
    result = {
        "completed": error is None and base_state == "COMPLETED" and len(got_losses) == last + 1,
        "config": asdict(cfg), "steps": last + 1, "max_steps": cfg.steps,
        "finished_at": ended if any(m["kind"] == "finish" for m in run.marks) else None,
        "world_sizes": sequence, "lost_steps": lost_steps(events, last + 1),
        "events": scale_events(events), "marks": run.marks, "base_state": base_state, "units": units,
        **timings(run.commits(), decisions, run.marks, cfg.min_nodes, cfg.max_nodes),
        "grace_s": cfg.grace_s, "wall_s": round(wall, 2), "log_dir": root,
        "base_capacity_log": _lines(glob.glob(os.path.join(run.spec.job_dir, f"{run.spec.job_name()}-*.out")), "capacity:"),
    }
    if cfg.reference and last >= 0:  # to the step the job ended after; keyed by what decides its bits
        from hp.chaos.references import ReferenceCache

        ref_demo = replace(demo, steps=last + 1)
        with open(policy) as f:
            key = ("slurm_elastic", f.read(), tuple(train_argv(ref_demo, "POLICY")), final)
        reference = (cache or ReferenceCache()).run(key, lambda d: reference_run(ref_demo, d, policy, ranks=final), root)
        ref_losses = {s: {e["loss"] for e in es} for s, es in commits(reference.events).items()}
        state = compare_state(reference, RunResult(0, wall, events, ""), nproc=final)
        result.update(losses_equal=ref_losses == got_losses and all(len(v) == 1 for v in got_losses.values()), **state)
        result["bitwise_equal"] = result["losses_equal"] and state["state_equal"]
        result["completed"] = result["completed"] and reference.returncode == 0
    if error is not None:
        result["error"] = error
    if not result["completed"]:
        result["error_tail"] = _tails(run.spec.job_dir)
    return result


def _lines(paths: list[str], needle: str) -> list[str]:
    out = []
    for path in sorted(paths):
        with open(path, errors="replace") as f:
            out += [line.strip() for line in f if needle in line]
    return out


def _tails(job_dir: str, n: int = 1500) -> dict[str, str]:
    out = {}
    for path in sorted(glob.glob(os.path.join(job_dir, "*.out"))):
        with open(path, errors="replace") as f:
            out[os.path.basename(path)] = f.read()[-n:]
    return out


"""The `hp demo` training job on several "nodes", driven step by step from a test.

:func:`hp.chaos.launch.run_job` runs a scenario's job to its end with faults fired on the way;
this is the same launch (:func:`~hp.chaos.launch.agent_flags`, :func:`~hp.chaos.launch.start_agent`)
held open, for tests that act on the job themselves. Each node runs
:func:`hp.checkpointless.demo.run.job_command` with the multi-node flags added, inside its namespace
of a :class:`~hp.chaos.topology.Topology`, with gloo on the node's veth. Node 0 hosts the controller and the store on its address. Every node logs to its
own directory; :meth:`MultiNodeJob.result` merges their event logs into one
:class:`~hp.checkpointless.demo.run.RunResult`, so ``compare`` and friends work unchanged.

    with Topology(2) as topo:
        job = MultiNodeJob(topo, DemoConfig(nproc=1, steps=30), root, spares=[1, 1]).start()
        job.wait_for_step(5); topo.kill_node(1)
        result = job.wait()
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
import uuid

from hp.chaos.launch import agent_flags, read_decisions, start_agent
from hp.chaos.topology import Topology
from hp.checkpointless.demo.run import DemoConfig, RunResult, job_command
from hp.checkpointless.events import read_events
from hp.core import auth
from hp.core.protocol import Event

CONTROLLER_PORT = 29400  # each namespace has its own ports: a fixed one cannot collide


class MultiNodeJob:
    """One demo job across every node of ``topo``; ``spares[i]`` hot spares on node ``i``."""

    def __init__(self, topo: Topology, cfg: DemoConfig, root: str, spares: list[int] | None = None,
                 faults: list[dict] | None = None, extra_env: dict[str, str] | None = None,
                 agent_flags: list[str] | None = None) -> None:
        self.topo, self.cfg, self.root = topo, cfg, root
        self.spares = spares if spares is not None else [cfg.spares] * topo.nodes
        if len(self.spares) != topo.nodes:
            raise ValueError(f"spares: one count per node ({topo.nodes}), got {self.spares}")
        self.faults = faults or []
        self.extra_env = extra_env or {}
        self.agent_flags = agent_flags or []
        self.procs: list[subprocess.Popen] = []
        self.exit_times: dict[int, float] = {}  # node -> time.time() its agent was seen gone
        self._start = 0.0

    def log_dir(self, node: int) -> str:
        return os.path.join(self.root, f"node{node}")

    def start(self) -> MultiNodeJob:
        os.makedirs(self.root, exist_ok=True)
        endpoint = f"{self.topo.address(0)}:{CONTROLLER_PORT}"
        env = {**os.environ, "HP_FAULTS": json.dumps(self.faults), auth.TOKEN_ENV: auth.new_token(),
               **self.extra_env}
        run_id = uuid.uuid4().hex[:12]
        self._start = time.monotonic()
        for i in range(self.topo.nodes):
            cfg = dataclasses.replace(self.cfg, spares=self.spares[i])
            cmd = job_command(cfg, self.log_dir(i),
                              agent_flags(self.topo.nodes, i, endpoint, ["--run-id", run_id, *self.agent_flags]))
            out = open(os.path.join(self.root, f"node{i}.out"), "w")
            self.procs.append(start_agent(self.topo, i, cmd, env, stdout=out, stderr=subprocess.STDOUT))
            out.close()  # the child has its own copy
        return self

    def events(self) -> list[dict]:
        events = [e for i in range(self.topo.nodes) for e in read_events(os.path.join(self.log_dir(i), "events"))]
        return sorted(events, key=lambda e: e["t"])

    def committed(self) -> int:
        """The newest step rank 0 committed so far (-1 before the first)."""
        return max((e["step"] for e in self.events() if e["event"] == Event.COMMIT and e.get("rank") == 0), default=-1)

    def poll(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None and i not in self.exit_times:
                self.exit_times[i] = time.time()

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.committed() < step:
            self.poll()
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"step {step} never committed (node 0 exit {self.procs[0].poll()}):\n"
                                   + self.output()[-3000:])
            time.sleep(0.02)

    def wait(self, timeout: float = 240) -> RunResult:
        """Wait for every agent; the result's return code is node 0's (the controller's node)."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.02)
        self.poll()
        return self.result()

    def returncodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def output(self, node: int | None = None) -> str:
        nodes = range(self.topo.nodes) if node is None else [node]
        out = []
        for i in nodes:
            path = os.path.join(self.root, f"node{i}.out")
            if os.path.exists(path):
                with open(path) as f:
                    out.append(f"--- node {i} ---\n{f.read()}")
        return "\n".join(out)

    def decisions(self) -> list[dict]:
        """Every node's controller decisions, oldest first (an HA job's leaders each log their own)."""
        return read_decisions([self.log_dir(i) for i in range(self.topo.nodes)])

    def result(self) -> RunResult:
        rc = self.procs[0].poll()
        return RunResult(-1 if rc is None else rc, time.monotonic() - self._start, self.events(), self.output())


def recovery_after(events: list[dict], t0: float) -> dict:
    """Seconds from an external fault at ``t0`` (wall clock) to the survivors noticing it, to the
    new generation forming, and to rank 0's first commit in it (None where it never happened)."""
    before = [e for e in events if e["event"] == Event.COMMIT and e.get("rank") == 0 and e["t"] < t0]
    old = before[-1]["generation"] if before else None
    after = [e for e in events if e["t"] >= t0]
    detect = next((e["t"] - t0 for e in after if e["event"] == Event.FAILURE_DETECTED), None)
    formed = next((e["t"] - t0 for e in after if e["event"] == Event.PG_READY and e.get("generation") != old), None)
    commit = next((e for e in after if e["event"] == Event.COMMIT and e.get("rank") == 0 and e["generation"] != old),
                  None)
    return {"detect_s": detect, "reformed_s": formed, "recovery_s": commit["t"] - t0 if commit else None,
            "resumed_step": commit["step"] if commit else None}

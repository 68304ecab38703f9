"""Capacity faults of an elastic job (``job.elastic``): ``preempt`` and ``join``.

Both act on agents, from outside the job, like a cluster scheduler does: ``preempt`` is the
SIGTERM Slurm or Kubernetes sends a node's agent (its ranks leave at the next step boundary and
the agent exits 0, :meth:`hp.core.agent.departure.Departure.leave`); ``join`` starts a new agent for a node,
which joins the running job as spares that the job grows into once they are ready
(:class:`hp.core.controller.ElasticController`). Either fires while step ``at_step`` runs or, with
``at_event``, on an event of the job (e.g. ``assigned``: a joiner was given its rank, the job is
re-forming to hydrate it).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from hp.chaos.faults.base import AtStep, FaultKind, FaultSpec, Injection, JobShape, LiveJob, ScenarioError
from hp.core.hookspecs import hookimpl


class PreemptAt(AtStep):
    """SIGTERM to the newest agent of node ``target.index`` (once it runs)."""

    def ready(self, job: LiveJob) -> bool:
        return super().ready(job) and job.agent_pid(self.spec.target.index) is not None

    def fire(self, job: LiveJob) -> Callable[[], None] | None:
        node = self.spec.target.index
        pid = job.agent_pid(node)
        self.record(job, pid=pid, node=node, signal="SIGTERM")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # it ended meanwhile
        return None


class JoinAt(AtStep):
    """A new agent for node ``target.index``, once that node has none running (a node that left or
    was lost joins again only after its old agent is gone)."""

    def ready(self, job: LiveJob) -> bool:
        return super().ready(job) and job.agent_pid(self.spec.target.index) is None

    def fire(self, job: LiveJob) -> Callable[[], None] | None:
        node = self.spec.target.index
        pid = job.start_agent(node, f"node{node}-join{self.spec.index}")
        self.record(job, pid=pid, node=node)
        return None


class Preempt(FaultKind):
    """Graceful preemption of node N: SIGTERM to its agent; its ranks leave at the next step boundary (elastic jobs)."""

    name, targets, event_trigger, elastic_only = "preempt", ("node",), True, True

    def validate(self, raw: dict, key: str, index: int, job: JobShape) -> FaultSpec:
        spec = super().validate(raw, key, index, job)
        if spec.target.index == 0 and job.controller == "agent":
            raise ScenarioError(f"{key}.target", "node 0's agent hosts the job's controller: preempting it "
                                                 "preempts the whole job (it saves and stops, it does not go on); "
                                                 "preempt another node or use job.controller: standalone")
        return spec

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        return Injection(actions=[PreemptAt(spec)])


class Join(FaultKind):
    """A new agent for node N (job.nproc_per_node processes) joins the running job as spares it grows into (elastic jobs)."""

    name, targets, event_trigger, elastic_only = "join", ("node",), True, True

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        return Injection(actions=[JoinAt(spec)])


@hookimpl
def hp_fault_kinds() -> list[FaultKind]:
    return [Preempt(), Join()]

"""Node and network faults between the node namespaces of a ``nodes > 1`` job: ``node``,
``partition``, ``loss``. The mechanics (namespaces, iptables rules inside them, killing a whole
namespace) are :class:`hp.chaos.topology.Topology`'s; these kinds say when and to whom.
"""

from __future__ import annotations

from collections.abc import Callable

from hp.chaos.faults.base import (
    AtStep,
    FaultKind,
    FaultSpec,
    Injection,
    JobShape,
    LiveJob,
    Param,
    positive,
)
from hp.core.hookspecs import hookimpl
from hp.core.protocol import Event


class TopologyAt(AtStep):
    """Apply a topology fault while step ``at_step`` runs; ``duration_s`` later, heal the network."""

    def __init__(self, spec: FaultSpec, apply: Callable[[object], object], heals: bool) -> None:
        super().__init__(spec)
        self._apply, self._heals = apply, heals

    def fire(self, job: LiveJob) -> Callable[[], None] | None:
        self.record(job, **{k: v for k, v in self.spec.params.items() if v is not None})
        self._apply(job.topology)
        if not self._heals:
            return None

        def undo() -> None:
            job.topology.heal()  # removes every partition and loss rule of the job's topology
            job.record(Event.FAULT_RESUMED, fault=self.spec.index)
        return undo


class Node(FaultKind):
    """The agent and every worker and spare of one node die together (SIGKILL of its whole namespace)."""

    name, targets, min_nodes, event_trigger = "node", ("node",), 2, True

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        node = spec.target.index
        return Injection(actions=[TopologyAt(spec, lambda topo: topo.kill_node(node), heals=False)])


class Partition(FaultKind):
    """Cut node N off from every other node (iptables mode drop or reject); with duration_s, heal it after."""

    name, targets, min_nodes, event_trigger = "partition", ("node",), 2, True
    params = {"duration_s": Param(float, optional=True, check=positive),
              "mode": Param(str, default="drop",
                            check=lambda m: None if m in ("drop", "reject") else "must be 'drop' or 'reject'")}

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        node, mode = spec.target.index, spec.params["mode"]

        def apply(topo) -> None:
            for other in range(job.nodes):
                if other != node:
                    topo.partition(node, other, mode=mode)
        return Injection(actions=[TopologyAt(spec, apply, heals=spec.params["duration_s"] is not None)])


class Loss(FaultKind):
    """Drop each packet to or from node N with probability (iptables -m statistic); with duration_s, heal it after."""

    name, targets, min_nodes, event_trigger = "loss", ("node",), 2, True
    params = {"probability": Param(float, check=lambda p: None if 0 < p < 1 else f"must be in (0, 1), got {p}"),
              "duration_s": Param(float, optional=True, check=positive)}

    def inject(self, spec: FaultSpec, job: JobShape) -> Injection:
        node, p = spec.target.index, spec.params["probability"]
        return Injection(actions=[TopologyAt(spec, lambda topo: topo.loss(node, p),
                                             heals=spec.params["duration_s"] is not None)])


@hookimpl
def hp_fault_kinds() -> list[FaultKind]:
    return [Node(), Partition(), Loss()]

"""Kubernetes watch events folded into hp's scale decisions: a pure state machine, no I/O.

:class:`JobWatch` receives the events of three watches, exactly as the API sends them
(``{"type": "ADDED"|"MODIFIED"|"DELETED"|"ERROR", "object": {...}}``): the job's Pods, the cluster's Nodes
and Kueue's Workloads. From them it keeps what the Slurm backend reads from ``squeue``/``sinfo`` and
answers with the same contracts: :class:`hp.core.scaling.ScaleEvent` decisions and a
:class:`hp.core.schedulers.api.Capacity`.

============================================================== ===============================================
observed                                                       decision
============================================================== ===============================================
a worker pod's ``DisruptionTarget`` condition becomes True      ``preemption``, count 1 (kube-scheduler
(PreemptionByScheduler, EvictionByEvictionAPI, TerminationByKubelet, preemption, a drain, node pressure): the
DeletionByTaintManager)                                         pod has its grace period to leave
a job's Kueue Workload gets ``Evicted`` or ``Preempted`` True   ``preemption``, count = its JobSet's pods alive
a worker pod's Node reports Ready False/Unknown for             ``failure``, count = its pods there (decided
``not_ready_grace_s``                                           by :meth:`JobWatch.tick` once the grace ends)
a worker pod deleted, or Failed, with no disruption announced   ``failure``, count 1
a job's Workload becomes ``Admitted``                           ``capacity`` (quota given back)
more worker pods Running, Ready, on Ready nodes than last told  ``capacity`` (e.g. the elastic group's pods)
============================================================== ===============================================

A pod is counted at most once (the first of preemption or failure). States (:class:`Phase`): PENDING (no
worker pod ready), RUNNING, PREEMPTING (a disruption is under way: ``Capacity.preemption_requested``),
SUSPENDED (every Workload of the job evicted or not admitted), STALE (the watch expired: re-list, then
:meth:`JobWatch.reset`). The clock is injected, as in :class:`hp.core.controller.Controller`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hp.core.schedulers.k8s.manifest import (
    GROUP_LABEL, JOB_INDEX_ANNOTATION, JOB_LABEL, ROLE_LABEL, VOLCANO_INDEX_ANNOTATION,
)
from hp.core.scaling import CAPACITY, FAILURE, PREEMPTION, ScaleEvent
from hp.core.schedulers.api import Capacity

EVENT_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "ERROR", "BOOKMARK"})
EVICTED_CONDITIONS = ("Evicted", "Preempted")
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"


class Phase(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    PREEMPTING = "preempting"
    SUSPENDED = "suspended"
    STALE = "stale"


class WatchEventError(ValueError):
    """An event that is not a watch event of a Pod, Node or Workload."""


@dataclass(frozen=True)
class PodRef:
    """A worker pod a decision is about: ``node_rank`` (its group's offset plus its index; None where the pod
    does not say) and ``uid``, the node's incarnation (``HP_NODE_INCARNATION``)."""

    name: str
    uid: str
    node_rank: int | None


@dataclass(frozen=True)
class Decision:
    """One decision: ``event`` for the controller's :class:`hp.core.scaling.Scaler`, and why; ``pods``:
    the worker pods it counts (failure and preemption decisions)."""

    at: float
    event: ScaleEvent
    reason: str
    capacity: Capacity
    pods: tuple[PodRef, ...] = ()


@dataclass
class _Pod:
    group: str
    name: str = ""
    node_rank: int | None = None
    jobset: str = ""  # the JobSet that owns it (jobset.sigs.k8s.io/jobset-name): its Kueue Workload's owner
    node: str = ""
    phase: str = "Pending"
    ready: bool = False
    disrupted: bool = False


@dataclass
class _Workload:
    admitted: bool = False
    evicted: bool = False
    pods: int = 0
    owners: frozenset[str] = frozenset()  # the JobSet(s) it admits


def node_rank(pod: dict[str, Any]) -> int | None:
    """A worker pod's ``--node-rank``, as its wrapper computes it (``HP_RANK_OFFSET`` + its index), from the
    pod object alone; None where it does not say (not one of hp's worker pods)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    index = annotations.get(JOB_INDEX_ANNOTATION, annotations.get(VOLCANO_INDEX_ANNOTATION))
    containers = (pod.get("spec") or {}).get("containers") or []
    env = {e.get("name"): e.get("value") for c in containers if isinstance(c, dict)
           for e in c.get("env") or [] if isinstance(e, dict)}
    offset = env.get("HP_RANK_OFFSET")
    if not (isinstance(index, str) and index.isdigit() and isinstance(offset, str) and offset.isdigit()):
        return None
    return int(offset) + int(index)


@dataclass
class JobWatch:
    """The scheduler's view of one hp job (``job``: the manifests' ``hp.dev/job`` label, i.e. its name)."""

    job: str
    nproc_per_node: int = 1
    not_ready_grace_s: float = 0.0
    clock: Callable[[], float] = time.monotonic
    phase: Phase = Phase.PENDING
    pods: dict[str, _Pod] = field(default_factory=dict)  # by uid
    nodes_not_ready: dict[str, float] = field(default_factory=dict)  # node -> since
    workloads: dict[str, _Workload] = field(default_factory=dict)  # by name
    counted: set[str] = field(default_factory=set)  # pod uids already preempted or failed
    told_hosts: int = 0
    decisions: list[Decision] = field(default_factory=list)

    def feed(self, event: dict[str, Any]) -> list[Decision]:
        """Fold one watch event in; the decisions it led to (also appended to :attr:`decisions`)."""
        if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES or not isinstance(event.get("object"), dict):
            raise WatchEventError(f"not a watch event: {str(event)[:120]}")
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":  # e.g. 410 Gone: the resourceVersion is too old; the caller re-lists
            self.phase = Phase.STALE
            return []
        if kind == "BOOKMARK":
            return []
        out: list[Decision] = []
        handler = {"Pod": self._pod, "Node": self._node, "Workload": self._workload}.get(obj.get("kind", ""))
        if handler is None:
            raise WatchEventError(f"unexpected kind {obj.get('kind')!r} in a watch event")
        handler(kind, obj, out)
        out += self.tick()
        return out

    def tick(self) -> list[Decision]:
        """Decisions due by the clock alone: pods on a node NotReady for ``not_ready_grace_s``; capacity."""
        now, out = self.clock(), []
        for node, since in self.nodes_not_ready.items():
            if now - since >= self.not_ready_grace_s:
                lost = [uid for uid, p in self.pods.items() if p.node == node and uid not in self.counted]
                if lost:
                    self.counted.update(lost)
                    self._decide(out, FAILURE, len(lost), f"node {node} NotReady", lost)
        hosts = self.capacity().hosts
        if hosts > self.told_hosts:
            self._decide(out, CAPACITY, 0, f"{hosts} worker pods ready (was {self.told_hosts})")
        self.told_hosts = hosts
        self._phase()
        return out

    def reset(self) -> None:
        """Forget everything before a re-list (the ADDED events of the list follow)."""
        self.pods.clear(), self.nodes_not_ready.clear(), self.workloads.clear()
        self.phase = Phase.PENDING

    def capacity(self) -> Capacity:
        live = self._live()
        hosts = len(live)
        disrupted = any(p.disrupted and p.phase not in ("Succeeded", "Failed") for p in self.pods.values())
        # an evicted Workload asks for its pods back while any of them is still there
        evicted = any(w.evicted and p.jobset in w.owners and p.phase in ("Pending", "Running")
                      for w in self.workloads.values() for p in self.pods.values())
        return Capacity(hosts=hosts, slots_per_host=self.nproc_per_node, preemption_requested=disrupted or evicted,
                        replicas=hosts * self.nproc_per_node)

    def hosts(self) -> list[str]:
        """Node names of the worker pods that count as capacity (one per pod, in group order)."""
        return [p.node for p in sorted(self._live(), key=lambda p: (p.group != "base", p.node))]

    def _live(self) -> list[_Pod]:
        return [p for uid, p in self.pods.items() if p.phase == "Running" and p.ready and not p.disrupted
                and uid not in self.counted and p.node not in self.nodes_not_ready]

    # --- handlers -------------------------------------------------------------------------------------------

    def _pod(self, kind: str, obj: dict[str, Any], out: list[Decision]) -> None:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(JOB_LABEL) != self.job or labels.get(ROLE_LABEL) != "worker":
            return
        uid = meta.get("uid") or meta.get("name", "")
        status, spec = obj.get("status") or {}, obj.get("spec") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        pod = self.pods.setdefault(uid, _Pod(group=labels.get(GROUP_LABEL, ""), jobset=labels.get(JOBSET_LABEL, ""),
                                             name=meta.get("name", ""), node_rank=node_rank(obj)))
        pod.node = spec.get("nodeName") or pod.node
        pod.phase = status.get("phase") or pod.phase
        pod.ready = conditions.get("Ready", {}).get("status") == "True"
        disruption = conditions.get("DisruptionTarget", {})
        if disruption.get("status") == "True" and not pod.disrupted:
            pod.disrupted = True
            if uid not in self.counted:
                self.counted.add(uid)
                self._decide(out, PREEMPTION, 1, f"pod {meta.get('name')}: {disruption.get('reason', 'DisruptionTarget')}",
                             [uid])
        if uid not in self.counted and (kind == "DELETED" and pod.phase != "Succeeded" or pod.phase == "Failed"):
            self.counted.add(uid)
            self._decide(out, FAILURE, 1, f"pod {meta.get('name')} {'deleted' if kind == 'DELETED' else 'failed'}", [uid])
        if kind == "DELETED":
            del self.pods[uid]

    def _node(self, kind: str, obj: dict[str, Any], out: list[Decision]) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        ready = next((c.get("status") for c in (obj.get("status") or {}).get("conditions") or []
                      if c.get("type") == "Ready"), None)
        if kind == "DELETED" or ready in ("False", "Unknown"):
            self.nodes_not_ready.setdefault(name, self.clock())
        else:
            self.nodes_not_ready.pop(name, None)

    def _workload(self, kind: str, obj: dict[str, Any], out: list[Decision]) -> None:
        meta = obj.get("metadata") or {}
        owners = {o.get("name") for o in meta.get("ownerReferences") or [] if o.get("kind") == "JobSet"}
        if not owners & {self.job, f"{self.job}-elastic"}:
            return
        name = meta.get("name", "")
        if kind == "DELETED":
            self.workloads.pop(name, None)
            return
        conditions = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}
        w = self.workloads.setdefault(name, _Workload())
        w.owners = frozenset(owners)
        w.pods = sum(int(ps.get("count") or 0) for ps in (obj.get("spec") or {}).get("podSets") or [])
        evicted = next((c for t in EVICTED_CONDITIONS if (c := conditions.get(t, {})).get("status") == "True"), None)
        admitted = conditions.get("Admitted", {}).get("status") == "True"
        if evicted is not None and not w.evicted:
            alive = [uid for uid, p in self.pods.items() if uid not in self.counted and p.jobset in owners
                     and p.phase in ("Pending", "Running")]
            self.counted.update(alive)
            self._decide(out, PREEMPTION, len(alive) or w.pods,
                         f"workload {name} {evicted.get('type')}: {evicted.get('reason', '')}".rstrip(": "), alive)
        if admitted and not w.admitted and evicted is None:
            self._decide(out, CAPACITY, 0, f"workload {name} admitted")
        w.evicted, w.admitted = evicted is not None, admitted

    def _decide(self, out: list[Decision], kind: str, count: int, reason: str, uids: list[str] = ()) -> None:
        self._phase()
        pods = tuple(PodRef(self.pods[u].name, u, self.pods[u].node_rank) for u in uids if u in self.pods)
        decision = Decision(self.clock(), ScaleEvent(kind, count), reason, self.capacity(), pods)
        out.append(decision)
        self.decisions.append(decision)

    def _phase(self) -> None:
        if self.phase is Phase.STALE:
            return
        cap = self.capacity()
        if self.workloads and all(w.evicted or not w.admitted for w in self.workloads.values()):
            self.phase = Phase.SUSPENDED
        elif cap.preemption_requested:
            self.phase = Phase.PREEMPTING
        else:
            self.phase = Phase.RUNNING if cap.hosts else Phase.PENDING

"""Quotas from Slurm QOS limits: how many nodes an elastic hp job may hold now (pure; no Slurm here).

An elastic job on Slurm is several Slurm jobs (a base and one-node units, :mod:`hp.core.schedulers.slurm.job`), all
under one QOS. The limits that bound how far it can grow are those that count nodes or running jobs:

==================  ==========================  ===============================================
sacctmgr field      counts                      over
==================  ==========================  ===============================================
``GrpTRES=node=N``  nodes of running jobs       every job of the QOS
``MaxTRESPU``       nodes of running jobs       this user's jobs of the QOS
``MaxJobsPU``       running jobs                this user's jobs of the QOS (a unit is one job
                                                of one node, so one more job is one more node)
==================  ==========================  ===============================================

Slurm enforces them itself (``AccountingStorageEnforce=limits``): a unit past the quota pends with a
``QOS...Limit`` reason and starts once the quota allows, so the job grows into a raised quota without hp
doing anything. :func:`quota_hosts` says how far that is: what the job holds plus the tightest limit's
headroom.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hp.core.schedulers.slurm.records import SlurmJob

QOS_FORMAT = "format=Name,GrpTRES,MaxTRESPU,MaxJobsPU"  # sacctmgr -nP show qos NAME QOS_FORMAT
ALLOCATED = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"})  # holding nodes


@dataclass(frozen=True)
class QosLimits:
    name: str
    grp_nodes: int | None = None  # GrpTRES node=
    nodes_per_user: int | None = None  # MaxTRESPerUser node=
    jobs_per_user: int | None = None  # MaxJobsPerUser

    @classmethod
    def parse(cls, line: str) -> QosLimits:
        """One line of ``sacctmgr -nP show qos NAME`` with :data:`QOS_FORMAT`."""
        name, grp, per_user, jobs = (line.strip().split("|") + ["", "", "", ""])[:4]
        return cls(name, _tres_nodes(grp), _tres_nodes(per_user), int(jobs) if jobs.isdigit() else None)

    @property
    def limited(self) -> bool:
        return any(v is not None for v in (self.grp_nodes, self.nodes_per_user, self.jobs_per_user))


def _tres_nodes(tres: str) -> int | None:
    """``node`` of a TRES string (``cpu=8,node=3``); None where it has none."""
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key == "node" and value.isdigit():
            return int(value)
    return None


def quota_hosts(limits: QosLimits, jobs: Iterable[SlurmJob], user: str, own: set[str]) -> int | None:
    """The most nodes the job whose Slurm jobs are ``own`` (ids) may hold under ``limits`` now: the nodes
    it holds plus the headroom the tightest limit leaves; None where the QOS limits nothing of this."""
    running = [j for j in jobs if j.state in ALLOCATED and j.qos == limits.name]
    mine = [j for j in running if j.user == user]
    headroom = [limit - used for limit, used in (
        (limits.grp_nodes, sum(j.node_count for j in running)),
        (limits.nodes_per_user, sum(j.node_count for j in mine)),
        (limits.jobs_per_user, len(mine)),
    ) if limit is not None]
    if not headroom:
        return None
    return sum(j.node_count for j in running if j.job_id in own) + max(0, min(headroom))

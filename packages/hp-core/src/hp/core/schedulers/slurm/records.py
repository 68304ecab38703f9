"""What Slurm's own commands say about a node (``sinfo``) and a job (``squeue``), as values.

Apart from the client (:mod:`hp.core.schedulers.slurm.backend`) so that the quota arithmetic
(:mod:`hp.core.schedulers.slurm.quota`) reads jobs without importing the client that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVE_JOB_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                               "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT"})


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # sinfo's base state, lower case: idle, allocated, mixed, down, drained, ...
    cpus: int
    partitions: tuple[str, ...]


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    partition: str
    state: str  # squeue's JOB_STATE: PENDING, RUNNING, ...
    nodes: str  # a Slurm node list (n[1-2]); empty while pending
    node_count: int
    reason: str = "None"  # why it pends: Resources, Priority, JobHeldUser, BeginTime, Dependency, ...
    het_job_id: str = ""  # a heterogeneous job's components (TorchX submits one) share it
    name: str = ""
    qos: str = ""
    user: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_JOB_STATES

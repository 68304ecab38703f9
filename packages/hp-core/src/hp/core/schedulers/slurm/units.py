"""The base job of an elastic hp job on Slurm: its agents, and the scaling units it keeps queued.

:class:`UnitKeeper` is the decision, pure (an injected clock, no Slurm): given the unit jobs Slurm
knows, which slots need a new unit job now. Each slot (a node rank in ``min_nodes..max_nodes-1``) is
in one of three states, read from its newest job:

===========  ==========================================================  ======================
state        the newest job of the slot                                   the keeper
===========  ==========================================================  ======================
``empty``    none yet, or it ended (left when preempted, its node went    submits a new unit (at
             DOWN, it failed, it was cancelled)                           most every ``min_interval_s``)
``queued``   pending: waits for a node (the job grows when it starts)     waits
``running``  running: its agent is in the job, or joining it              waits
===========  ==========================================================  ======================

:func:`run_base` is the base job's batch step (``hp slurm base SPEC``): it starts the agents of the base
nodes with ``srun`` (:func:`hp.core.schedulers.slurm.job.base_steps`), keeps the units while they run (one
``squeue --name`` a second for the whole job, not per rank), and cancels every unit when they are done,
however they end. The base job runs with ``--no-kill``: when one of its nodes other than node 0 fails
(Slurm takes it out of the job and kills its agent: its ranks are lost, the job goes on without them), the
node's rank becomes one more slot, whose job (one node, in the base partition) replaces it: the job grows
back onto a healthy node as soon as one is free. Node 0 hosts the controller; its loss ends the job.
A node failure, of a base node or of a unit's (its job ends ``NODE_FAIL``), is told to the controller
at once (``node_failed``), so the job does not wait a heartbeat timeout to go on without it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from hp.core.node_failure import FailureReport
from hp.core.schedulers.slurm.backend import SlurmCli, SlurmError, SlurmScheduler
from hp.core.schedulers.slurm.job import (
    SlurmJobSpec,
    base_steps,
    head_endpoint,
    read_token,
    unit_script,
)
from hp.core.schedulers.slurm.records import SlurmJob

POLL_S = 1.0
CAPACITY_EVERY_S = 5.0  # the base logs the job's capacity (idle nodes, QOS quota, preemption) as it changes


class Slot(str, Enum):
    EMPTY = "empty"
    QUEUED = "queued"
    RUNNING = "running"


@dataclass
class UnitKeeper:
    """Which unit slots need a job (see the module docstring). ``names``: slot -> its jobs' name."""

    names: dict[int, str]
    clock: Callable[[], float] = time.monotonic
    min_interval_s: float = 2.0  # between two submissions for one slot (a unit that fails at once)
    max_submissions: int = 10_000  # then the keeper stops submitting: something is wrong
    submissions: int = 0
    _newest: dict[int, str] = field(default_factory=dict)  # slot -> the job id submitted last
    _submitted_at: dict[int, float] = field(default_factory=dict)

    def states(self, jobs: Iterable[SlurmJob]) -> dict[int, Slot]:
        by_slot = {slot: [] for slot in self.names}
        slot_of = {name: slot for slot, name in self.names.items()}
        for job in jobs:
            if job.name in slot_of:
                by_slot[slot_of[job.name]].append(job)
        out = {}
        for slot, found in by_slot.items():
            newest = max(found, key=lambda j: int(j.job_id), default=None)
            if newest is None and slot in self._newest:  # submitted, not listed yet (or forgotten): trust it
                out[slot] = Slot.QUEUED
            elif newest is None or not newest.active:
                out[slot] = Slot.EMPTY
            else:
                out[slot] = Slot.QUEUED if newest.state == "PENDING" else Slot.RUNNING
        return out

    def due(self, jobs: Iterable[SlurmJob]) -> list[int]:
        """The slots to submit a unit for now."""
        jobs = list(jobs)
        listed = {job.job_id for job in jobs}
        for slot, job_id in list(self._newest.items()):
            if job_id in listed or self.clock() - self._submitted_at[slot] > 60:
                del self._newest[slot]  # listed now (its state is read), or gone from Slurm's memory
        now = self.clock()
        return [slot for slot, state in sorted(self.states(jobs).items())
                if state == Slot.EMPTY and self.submissions < self.max_submissions
                and now - self._submitted_at.get(slot, -float("inf")) >= self.min_interval_s]

    def submitted(self, slot: int, job_id: str) -> None:
        self._newest[slot], self._submitted_at[slot] = job_id, self.clock()
        self.submissions += 1

    @staticmethod
    def active(jobs: Iterable[SlurmJob]) -> list[str]:
        return [job.job_id for job in jobs if job.active]


def _say(message: str) -> None:
    print(f"[hp slurm base] {message}", file=sys.stderr, flush=True)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # scancel of the base: the finally below cancels the units


@dataclass
class FailedUnits:
    """Unit jobs Slurm ended ``NODE_FAIL`` (their node failed, or was set DOWN). Each is told to the
    controller once, ``grace_s`` after it was first seen: a node set DOWN gets Slurm's SIGTERM first and its
    ranks leave at a step boundary within the grace period (the report then changes nothing), one that
    died has nothing to wait for, and its ranks are lost now rather than at the heartbeat timeout. Until
    it is told, the slot is held: no new unit for it, which could join as that node before the report
    (that would name the new node)."""

    grace_s: float
    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, tuple[int, float]] = field(default_factory=dict)  # job id -> (slot, first seen)
    _told: set[str] = field(default_factory=set)

    def observe(self, jobs: Iterable[SlurmJob], names: dict[int, str]) -> None:
        slot_of = {name: slot for slot, name in names.items()}
        for job in jobs:
            if job.state == "NODE_FAIL" and job.name in slot_of and job.job_id not in self._told | set(self._seen):
                self._seen[job.job_id] = (slot_of[job.name], self.clock())

    def due(self) -> list[tuple[int, str]]:
        """(slot, job id) to tell the controller now; each once."""
        now, out = self.clock(), []
        for job_id, (slot, seen) in list(self._seen.items()):
            if now - seen >= self.grace_s:
                del self._seen[job_id]
                self._told.add(job_id)
                out.append((slot, job_id))
        return out

    def holds(self, slot: int) -> bool:
        return any(s == slot for s, _ in self._seen.values())


class _CapacityLog:
    """The job's capacity (its base and units: :meth:`SlurmScheduler.capacity`), logged when it changes."""

    def __init__(self, scheduler: SlurmScheduler, partition: str | None) -> None:
        self.scheduler, self.partition, self.last, self.next = scheduler, partition, None, 0.0

    def poll(self) -> None:
        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + CAPACITY_EVERY_S
        try:
            cap = self.scheduler.capacity(self.partition)
        except SlurmError as e:
            cap = str(e)
        if cap != self.last:
            self.last = cap
            _say(cap if isinstance(cap, str) else f"capacity: {cap.hosts} node(s), QOS quota "
                 f"{'none' if cap.quota_hosts is None else cap.quota_hosts}, preemption pending: "
                 f"{'yes' if cap.preemption_requested else 'no'}")


def run_base(spec: SlurmJobSpec, cli: SlurmCli, job_id: str, nodelist: str, poll_s: float = POLL_S) -> int:
    """The base job's batch step (see the module docstring); node 0's agent's exit code."""
    signal.signal(signal.SIGTERM, _terminated)
    endpoint = head_endpoint(cli, nodelist, spec.port)
    hosts = cli.hostnames(nodelist)  # node rank k runs on hosts[k] (srun's SLURM_NODEID order)
    keeper = UnitKeeper({slot: spec.job_name(slot) for slot in spec.unit_slots})
    _say(f"job {job_id}: controller at {endpoint}; {spec.min_nodes} base node(s), unit slots "
         f"{list(spec.unit_slots)}")
    head, *rest = [subprocess.Popen(argv) for argv in base_steps(spec, endpoint, hosts)]
    failures, failed = FailureReport(endpoint, lambda: read_token(spec), log=_say), FailedUnits(grace_s=spec.grace_period_s + 2 * poll_s)
    base_name = spec.job_name()
    capacity = _CapacityLog(SlurmScheduler(job_names=(base_name, *keeper.names.values())),
                            spec.unit_partition or spec.base_partition)
    try:
        while head.poll() is None:
            capacity.poll()
            try:
                jobs = cli.jobs([base_name, *keeper.names.values()])
                for slot in _lost_base_slots(jobs, job_id, hosts, cli, keeper):
                    if failures.report(slot, f"Slurm took {hosts[slot]} out of job {job_id}"):
                        keeper.names[slot] = spec.job_name(slot)
                        _say(f"base node {slot} ({hosts[slot]}) failed: the job goes on without it, and a "
                             f"replacement job takes its slot")
                failed.observe(jobs, keeper.names)
                for slot, unit in failed.due():
                    failures.report(slot, f"Slurm ended unit job {unit} with NODE_FAIL")
                for slot in (s for s in keeper.due(jobs) if not failed.holds(s)):
                    unit = cli.sbatch(unit_script(spec, slot, endpoint), *spec.sbatch_options)
                    keeper.submitted(slot, unit)
                    _say(f"unit {slot}: submitted job {unit}")
            except SlurmError as e:  # slurmctld busy or restarting: the training goes on; ask again
                _say(f"units: {e}")
            try:
                head.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
    finally:
        try:
            for unit in UnitKeeper.active(cli.jobs(list(keeper.names.values()))):
                cli.scancel(unit)
        except SlurmError as e:
            _say(f"could not cancel the units: {e}")
        for step in (head, *rest):
            if step.poll() is None:
                step.terminate()
            step.wait()
    _say(f"agents exited: node 0 {head.returncode}" + (f", the other base nodes {rest[0].returncode}" if rest else ""))
    return head.returncode


def _lost_base_slots(jobs: list[SlurmJob], job_id: str, hosts: list[str], cli: SlurmCli,
                     keeper: UnitKeeper) -> list[int]:
    """Base node ranks (never 0: the controller's) whose host left the base job (it failed; the job has
    ``--no-kill``) and that have no replacement slot yet."""
    base = next((j for j in jobs if j.job_id == job_id), None)
    if base is None or base.node_count >= len(hosts):
        return []
    held = set(cli.hostnames(base.nodes))
    return [rank for rank, host in enumerate(hosts) if rank > 0 and host not in held and rank not in keeper.names]

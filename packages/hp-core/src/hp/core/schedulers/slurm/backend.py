"""The ``slurm`` scheduler backend: hosts, capacity, submission and cancellation on a Slurm cluster.

Everything goes through Slurm's own commands (``sinfo``/``squeue`` with ``--json``, ``scontrol``,
``sbatch``, ``scancel``), so it needs nothing but a client configured for the cluster (``SLURM_CONF``
or ``/etc/slurm/slurm.conf``) and no accounting. TorchX's slurm scheduler submits an ``AppDef``
(:meth:`SlurmScheduler.submit`, a heterogeneous ``sbatch`` job, one ``srun`` for all roles), but reads
a job's state only through ``sacct`` (slurmdbd accounting) and reports PREEMPTED as FAILED: hp reads
state from ``squeue`` instead (:meth:`SlurmScheduler.state`, :meth:`SlurmScheduler.wait`).

Capacity (``source`` names the partition, else the job's own): the hosts the job could use now are the
partition's idle nodes plus the nodes it holds, capped by its QOS quota (:mod:`hp.core.schedulers.slurm.quota`,
where the cluster enforces limits); a pending job of a partition with a higher ``PriorityTier`` that
shares nodes with this one is preemption on its way. An elastic job's base logs it as it changes
(:func:`hp.core.schedulers.slurm.units.run_base`); ``hp slurm capacity`` prints it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hp.core.config import check_name
from hp.core.errors import BackendUnavailableError, UsageError
from hp.core.schedulers.api import Capacity, SchedulerBackend
from hp.core.schedulers.slurm.quota import ALLOCATED, QOS_FORMAT, QosLimits, quota_hosts
from hp.core.schedulers.slurm.records import ACTIVE_JOB_STATES, SlurmJob, SlurmNode

if TYPE_CHECKING:
    from torchx.specs import AppDef

CLI_TIMEOUT_S = 30.0
FREE_STATES = frozenset({"idle"})  # a node Slurm would give to a new job now
WAITING_FOR_NODES = frozenset({"Resources", "Priority", "None"})  # None: not yet looked at by the scheduler


class SlurmError(UsageError):
    """A Slurm command failed or is missing: one line, with the command and Slurm's own message."""


class SlurmCli:
    """Slurm's client commands, run with ``env`` (e.g. ``SLURM_CONF``) over the process's own."""

    def __init__(self, env: Mapping[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S) -> None:
        self._env = {**os.environ, **(env or {})}
        self._timeout = timeout_s

    def available(self) -> bool:
        return shutil.which("sinfo", path=self._env.get("PATH")) is not None

    def run(self, *argv: str, stdin: str | None = None) -> str:
        if shutil.which(argv[0], path=self._env.get("PATH")) is None:
            raise BackendUnavailableError(f"slurm: `{argv[0]}` is not on PATH (is this a Slurm client?)")
        try:
            done = subprocess.run(argv, input=stdin, env=self._env, capture_output=True, text=True,
                                  timeout=self._timeout)
        except subprocess.TimeoutExpired:
            raise SlurmError(f"slurm: {argv[0]} did not answer in {self._timeout:g} s") from None
        if done.returncode != 0:
            why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
            raise SlurmError(f"slurm: {argv[0]} failed: {why}")
        return done.stdout

    def _json(self, *argv: str) -> dict:
        try:
            return json.loads(self.run(*argv, "--json"))
        except json.JSONDecodeError as e:
            raise SlurmError(f"slurm: `{argv[0]} --json` printed no JSON ({e})") from None

    def nodes(self, partition: str | None = None) -> list[SlurmNode]:
        out = self._json("sinfo", *(("-p", partition) if partition else ()))
        return [SlurmNode(n["name"], str(n["state"]).lower(), int(n["cpus"]), tuple(n.get("partitions") or ()))
                for n in out.get("nodes", [])]

    def jobs(self, names: list[str] | None = None) -> list[SlurmJob]:
        """The jobs Slurm knows (ended ones for ``MinJobAge``); ``names``: only jobs of these names (filtered
        here too: ``squeue --json`` of Slurm 22.05 ignores its filter options)."""
        out = self._json("squeue", *((f"--name={','.join(names)}",) if names else ()))
        jobs = [SlurmJob(str(j["job_id"]), j["partition"], str(j["job_state"]), j.get("nodes") or "",
                         int(j.get("node_count") or 0), str(j.get("state_reason") or "None"),
                         str(j.get("het_job_id") or ""), str(j.get("name") or ""), str(j.get("qos") or ""),
                         str(j.get("user_name") or "")) for j in out.get("jobs", [])]
        return [j for j in jobs if j.name in names] if names else jobs

    def partitions(self) -> dict[str, dict[str, str]]:
        """Every partition's ``scontrol -o show partition`` fields, by name (one call)."""
        out = {}
        for line in self.run("scontrol", "-o", "show", "partition").splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if "PartitionName" in fields:
                out[fields["PartitionName"]] = fields
        return out

    def enforces_limits(self) -> bool:
        """Whether the cluster enforces QOS limits (``AccountingStorageEnforce`` names ``limits``)."""
        for line in self.run("scontrol", "show", "config").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "AccountingStorageEnforce":
                return "limits" in value.strip().split(",")
        return False

    def qos(self, name: str) -> QosLimits:
        check_name(name, "the QOS")  # an argument of sacctmgr: never one of its key=value options
        lines = [line for line in self.run("sacctmgr", "-nP", "show", "qos", name, QOS_FORMAT).splitlines() if line.strip()]
        if not lines:
            raise SlurmError(f"slurm: unknown QOS {name!r}")
        return QosLimits.parse(lines[0])

    def default_partition(self) -> str:
        default = next((name for name, f in self.partitions().items() if f.get("Default") == "YES"), None)
        if default is None:
            raise SlurmError("slurm: the cluster has no default partition: name one")
        return default

    def hostnames(self, nodelist: str) -> list[str]:
        return self.run("scontrol", "show", "hostnames", nodelist).split() if nodelist else []

    def sbatch(self, script: str, *options: str) -> str:
        """Submit ``script`` (its text) with ``options``; the job id."""
        return self.run("sbatch", "--parsable", *options, stdin=script).strip().split(";")[0]

    def scancel(self, job_id: str, signal: str | None = None) -> None:
        self.run("scancel", *((f"--signal={signal}", "--full") if signal else ()), job_id)

    def set_node_state(self, node: str, state: str, reason: str = "hp") -> None:
        self.run("scontrol", "update", f"NodeName={node}", f"State={state}", f"Reason={reason}")


class SlurmScheduler(SchedulerBackend):
    """Slurm through its client commands; ``AppDef`` submission through TorchX's slurm scheduler."""

    name = "slurm"
    torchx_scheduler = "slurm"

    def __init__(self, env: Mapping[str, str] | None = None, job_names: tuple[str, ...] = (),
                 qos: str | None = None) -> None:
        """``job_names``: the names of this job's other Slurm jobs (an elastic job's units), whose nodes it
        holds too; ``qos``: the QOS whose quota applies (default: this job's, else ``SLURM_JOB_QOS``)."""
        self.cli = SlurmCli(env)
        self._env = {**os.environ, **(env or {})}
        self._names, self._qos = frozenset(job_names), qos

    def hosts(self) -> list[str]:
        """The nodes of the allocation this process runs in (``SLURM_JOB_NODELIST``)."""
        nodelist = self._env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise SlurmError("slurm: not inside a Slurm allocation (SLURM_JOB_NODELIST is not set)")
        return self.cli.hostnames(nodelist)

    def capacity(self, source: str | None = None) -> Capacity:
        """``source``: the partition (default: this job's, else the cluster's default one)."""
        partition = source or self._env.get("SLURM_JOB_PARTITION") or self.cli.default_partition()
        partitions = self.cli.partitions()
        if partition not in partitions:
            raise SlurmError(f"slurm: unknown partition {partition!r} (the cluster has {', '.join(sorted(partitions))})")
        mine = partitions[partition]
        nodes = [n for n in self.cli.nodes(partition) if partition in n.partitions]
        job_id = self._env.get("SLURM_JOB_ID")
        jobs = self.cli.jobs()
        own = [job for job in jobs if job.job_id == job_id or job.name in self._names]
        held = {host for job in own if job.state in ALLOCATED for host in self.cli.hostnames(job.nodes)}
        usable = [n for n in nodes if n.state in FREE_STATES or n.name in held]
        quota = self._quota(jobs, own)
        return Capacity(hosts=len(usable) if quota is None else min(len(usable), quota),
                        slots_per_host=min((n.cpus for n in nodes), default=0),
                        preemption_requested=self._preemption_pending(mine, partitions, {n.name for n in nodes}, jobs),
                        quota_hosts=quota)

    def _quota(self, jobs: list[SlurmJob], own: list[SlurmJob]) -> int | None:
        """Nodes the job's QOS lets it hold (None: no QOS named, or the cluster enforces no limits)."""
        qos = self._qos or next((j.qos for j in own if j.qos), None) or self._env.get("SLURM_JOB_QOS")
        if not qos or not self.cli.enforces_limits():
            return None
        limits = self.cli.qos(qos)
        user = next((j.user for j in own if j.user), None) or current_user()
        return quota_hosts(limits, jobs, user, {j.job_id for j in own})

    def _preemption_pending(self, mine: dict[str, str], partitions: dict[str, dict[str, str]], my_nodes: set[str],
                            jobs: list[SlurmJob]) -> bool:
        """A job of a partition with a higher PriorityTier that shares nodes with ``mine`` waits for nodes
        (reason Resources or Priority: not a held job, nor one waiting for its begin time or a dependency)."""
        tier = int(mine.get("PriorityTier", "1"))
        waiting = {j.partition for j in jobs if j.state == "PENDING" and j.reason in WAITING_FOR_NODES}
        for partition in waiting - {mine["PartitionName"]}:
            other = partitions.get(partition, {})
            if int(other.get("PriorityTier", "1")) > tier and my_nodes & set(self.cli.hostnames(other.get("Nodes", ""))):
                return True
        return False

    def submit(self, app: AppDef, cfg: dict | None = None) -> str:
        """Submit through TorchX (``sbatch`` of a heterogeneous job); the TorchX handle
        ``slurm://SESSION/JOBID``."""
        self._require()
        return super().submit(app, cfg)

    def submit_script(self, script: str, *options: str) -> str:
        """``sbatch`` a script of hp's own (a scaling unit joining a running job); the job id."""
        return self.cli.sbatch(script, *options)

    def state(self, handle: str) -> str | None:
        """The job's Slurm state from ``squeue`` (no accounting needed): a heterogeneous job's is its
        first active component's, else its first one's; None once Slurm forgot it (``MinJobAge``)."""
        job_id = _job_id(handle)
        parts = [j for j in self.cli.jobs() if job_id in (j.job_id, j.het_job_id)]
        return next((j.state for j in parts if j.active), parts[0].state if parts else None)

    def wait(self, handle: str, poll_s: float = 0.5):  # noqa: ANN201  (a Slurm state, not a TorchX AppStatus)
        """Block until the job ended (COMPLETED, FAILED, CANCELLED, PREEMPTED, ...); that state, or None
        if Slurm forgot it first."""
        while (state := self.state(handle)) in ACTIVE_JOB_STATES:
            time.sleep(poll_s)
        return state

    def cancel(self, handle: str) -> None:
        self.cli.scancel(_job_id(handle))

    def _require(self) -> None:
        if not self.cli.available():
            raise BackendUnavailableError("slurm: `sinfo` is not on PATH (is this a Slurm client?)")


def current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _job_id(handle: str) -> str:
    """``12``, or TorchX's ``slurm://SESSION/12``."""
    job_id = handle.rsplit("/", 1)[-1]
    if not job_id.replace("_", "").isdigit():
        raise SlurmError(f"slurm: {handle!r} is not a Slurm job id")
    return job_id

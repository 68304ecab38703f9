"""An elastic hp job on Slurm (``hp slurm submit``): a base allocation plus scaling units.

* **base**: one ``sbatch`` job of ``min_nodes`` nodes in ``base_partition`` (the high-priority one). Its
  batch step runs ``hp slurm base SPEC`` on the allocation's first node (:mod:`hp.core.schedulers.slurm.units`):
  ``srun`` starts one ``hp run`` agent per node (node ranks ``0..min_nodes-1``; node 0 hosts the
  controller at the first node's ``NodeAddr`` and ``port``) and, while they run, one scaling unit is kept
  queued or running for every slot ``min_nodes..max_nodes-1``.
* **unit** ``k``: a one-node ``sbatch`` job in ``unit_partition`` (the low-priority one), never requeued
  by Slurm, whose ``srun`` task is the agent of node rank ``k`` joining the running job (a grow). When a
  higher-priority job needs its node, Slurm sends that task SIGTERM and ``GraceTime`` later kills it:
  the agent's ranks leave at the next step boundary (a shrink) and the unit's job ends; the base submits
  unit ``k`` again, which waits in the queue until a node is free and then grows the job back. A node set
  DOWN ends its unit the same way (Slurm signals, then kills its tasks).

Why hp resubmits a unit instead of letting Slurm requeue it (``PreemptMode=REQUEUE``): a unit whose
ranks left within the grace time ends by itself, and Slurm records it COMPLETED, not requeued; a job
requeued by ``scontrol requeue`` waits about 120 s (``BeginTime``) before it may start again (both seen
on Slurm 22.05 with :class:`hp.chaos.clusters.slurm.LocalSlurm`).

Everything a job's processes read is in ``job_dir`` (on a file system every node sees): ``spec.json``
(this module's :class:`SlurmJobSpec`, JSON) and ``token`` (the job token), both 0600 in a 0700 directory;
the token never enters a script, an argument list or the environment Slurm stores with a job.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field, fields

from hp.core import auth
from hp.core.config import check_name
from hp.core.errors import UsageError
from hp.core.privfs import open_private, private_dir
from hp.core.schedulers.slurm.backend import SlurmCli, SlurmError

SPEC_FILE, TOKEN_FILE = "spec.json", "token"
HP = [sys.executable, "-m", "hp.core.cli"]  # the same interpreter on every node (a shared install)


@dataclass
class SlurmJobSpec:
    """One elastic job. ``entrypoint``: the training command as ``hp run`` takes it (``train.py ARGS`` or
    ``-m MODULE ARGS``); ``run_flags``: more ``hp run`` flags for every agent; ``sbatch_options``: more
    ``sbatch`` options for the base and every unit (``--gres=gpu:8``, ``--account=...``)."""

    entrypoint: list[str]
    job_dir: str
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    scaling_policy: str | None = None
    base_partition: str | None = None  # None: the cluster's default partition
    unit_partition: str | None = None
    port: int = 29400  # the controller's, on the base's first node
    run_id: str = "hp"
    grace_period_s: float = 30.0  # hp run --grace-period: keep it below the unit partition's GraceTime
    run_flags: list[str] = field(default_factory=list)
    sbatch_options: list[str] = field(default_factory=list)

    def validate(self) -> SlurmJobSpec:
        check_name(self.run_id, "--run-id")
        for name in ("base_partition", "unit_partition"):
            if getattr(self, name) is not None:
                check_name(getattr(self, name), f"--{name.replace('_', '-')}")
        checks = [
            (bool(self.entrypoint), "a training script (or -m MODULE) is required"),
            (1 <= self.min_nodes <= self.max_nodes, f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got "
                                                    f"{self.min_nodes}:{self.max_nodes}"),
            (self.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {self.nproc_per_node}"),
            (self.max_nodes == self.min_nodes or self.scaling_policy is not None,
             "an elastic job (--nnodes MIN:MAX with MIN < MAX) needs --scaling-policy"),
            (0 < self.port < 65536, f"--port must be in 1..65535, got {self.port}"),
            (self.grace_period_s > 0, f"--grace-period must be > 0, got {self.grace_period_s}"),
            (os.path.isabs(self.job_dir), f"--job-dir must be an absolute path, got {self.job_dir!r}"),
            # it goes into the sbatch script's #SBATCH --output= lines, which nothing quotes: a newline there
            # would start a command line of the script, a space end the option, a % be Slurm's pattern
            (not any(c.isspace() or not c.isprintable() or c in "%\\\"'`$;&|<>" for c in self.job_dir),
             f"--job-dir must not contain whitespace, control characters or any of %\\\"'`$;&|<>, got {self.job_dir!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        return self

    @property
    def unit_slots(self) -> range:
        """The node ranks of the scaling units."""
        return range(self.min_nodes, self.max_nodes)

    def job_name(self, slot: int | None = None) -> str:
        return job_name(self.run_id, slot)

    def path(self, name: str) -> str:
        return os.path.join(self.job_dir, name)

    @classmethod
    def load(cls, path: str) -> SlurmJobSpec:
        """The spec a job's processes act on: JSON, every field checked for its type, then validated."""
        try:
            with open(path, "rb") as f:
                raw = json.loads(f.read(1 << 20))
        except (OSError, ValueError) as e:
            raise UsageError(f"slurm job spec {path}: {e}") from None
        types = {f.name: f.type for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) - set(types) or not {"entrypoint", "job_dir"} <= set(raw):
            raise UsageError(f"slurm job spec {path}: not a job spec (fields {sorted(types)})")
        for name, value in raw.items():
            if not _has_type(value, types[name]):
                raise UsageError(f"slurm job spec {path}: {name} must be {types[name]}, got {value!r}")
        return cls(**raw).validate()


def job_name(run_id: str, slot: int | None = None) -> str:
    """``hp-RUNID-base``, or ``hp-RUNID-uK`` for the unit of node rank ``K``."""
    return f"hp-{run_id}-{'base' if slot is None else f'u{slot}'}"


def _has_type(value: object, spec: str) -> bool:
    if spec.startswith("list"):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    ok = {"int": int, "float": (int, float), "str": str}
    return (value is None and "None" in spec) or any(
        isinstance(value, ok[t]) and not isinstance(value, bool) for t in ok if t in spec.split(" | "))


def prepare(spec: SlurmJobSpec, token: str) -> str:
    """Write the job's directory (0700): its spec and token (0600). Returns the spec's path."""
    spec.validate()
    auth.check_token(token, "the job token")
    private_dir(spec.job_dir)
    for name, text in ((TOKEN_FILE, token), (SPEC_FILE, json.dumps(asdict(spec), indent=1))):
        fd = open_private(spec.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return spec.path(SPEC_FILE)


def read_token(spec: SlurmJobSpec) -> str:
    """The job token, from the job directory (what ``prepare`` wrote)."""
    try:
        with open(spec.path(TOKEN_FILE)) as f:
            return auth.check_token(f.read().strip(), f"the job token in {spec.path(TOKEN_FILE)}")
    except OSError as e:
        raise UsageError(f"{spec.path(TOKEN_FILE)}: {e.strerror}") from None


def agent_argv(spec: SlurmJobSpec, node_rank: int, endpoint: str, job_id: str) -> list[str]:
    """The ``hp run`` of node rank ``node_rank`` (its log directory is ``job_dir/node{rank}-{job id}``)."""
    elastic = ["--nnodes", f"{spec.min_nodes}:{spec.max_nodes}", "--scaling-policy", spec.scaling_policy] \
        if spec.max_nodes > spec.min_nodes else ["--nnodes", str(spec.min_nodes)]
    return [*HP, "run", *elastic, "--nproc-per-node", str(spec.nproc_per_node), "--node-rank", str(node_rank),
            "--rdzv-endpoint", endpoint, "--token-file", spec.path(TOKEN_FILE), "--run-id", spec.run_id,
            "--grace-period", f"{spec.grace_period_s:g}", "--log-dir", spec.path(f"node{node_rank}-{job_id}"),
            *spec.run_flags, *spec.entrypoint]


def _sbatch_header(spec: SlurmJobSpec, slot: int | None, partition: str | None, nodes: int) -> str:
    name = spec.job_name(slot)
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
             "#SBATCH --no-requeue", f"#SBATCH --output={spec.path(name)}-%j.out", "#SBATCH --open-mode=append"]
    if slot is None:
        lines.append("#SBATCH --no-kill")  # a failed node ends its agent, not the job (see base_steps)
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    return "\n".join(lines) + "\n"


def base_script(spec: SlurmJobSpec) -> str:
    """The base job: ``hp slurm base`` on its first node (:func:`hp.core.schedulers.slurm.units.run_base`)."""
    return (_sbatch_header(spec, None, spec.base_partition, spec.min_nodes)
            + shlex.join([*HP, "slurm", "base", spec.path(SPEC_FILE)]) + "\n")


def srun_agent(spec: SlurmJobSpec, endpoint: str, nodes: int, node_rank: int | None = None, offset: int = 0,
               where: tuple[str, ...] = ()) -> list[str]:
    """``srun`` of one agent per node (``hp slurm agent``); ``node_rank``: a unit's (else each task's
    ``SLURM_NODEID`` + ``offset``); ``where``: ``--nodelist``/``--exclude``. ``--no-kill``: a node that fails
    ends its own task only. Each task is given all of its node's CPUs (see :func:`unit_script` for a unit)."""
    rank = ["--node-rank", str(node_rank)] if node_rank is not None else ["--node-rank-offset", str(offset)] * bool(offset)
    return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--no-kill",
            f"--cpus-per-task={os.environ.get('SLURM_CPUS_ON_NODE', '1')}", *where,
            *HP, "slurm", "agent", spec.path(SPEC_FILE), "--endpoint", endpoint, *rank]


def base_steps(spec: SlurmJobSpec, endpoint: str, hosts: list[str]) -> list[list[str]]:
    """The base job's ``srun`` steps: node 0's agent (it hosts the controller: its exit is the job's) on the
    first host, then the other base nodes' (node ranks 1..) on the rest. Apart, because ``srun`` exits
    137 once one of its nodes failed, however its other tasks end: a base node lost to a hardware fault
    (the job has ``--no-kill``) must not fail a job that trained on without it."""
    steps = [srun_agent(spec, endpoint, 1, 0, where=(f"--nodelist={hosts[0]}",))]
    if len(hosts) > 1:
        steps.append(srun_agent(spec, endpoint, len(hosts) - 1, offset=1, where=(f"--exclude={hosts[0]}",)))
    return steps


def unit_script(spec: SlurmJobSpec, slot: int, endpoint: str) -> str:
    """Scaling unit ``slot``: one node's agent joining the job whose controller is at ``endpoint``; a slot
    of the base (below ``min_nodes``: the replacement of a base node that failed) in the base partition."""
    srun = [a for a in srun_agent(spec, endpoint, 1, slot) if not a.startswith("--cpus-per-task=")]
    partition = spec.base_partition if slot < spec.min_nodes else spec.unit_partition
    return (_sbatch_header(spec, slot, partition, 1)
            + f'exec srun --cpus-per-task="$SLURM_CPUS_ON_NODE" {shlex.join(srun[1:])}\n')


def head_endpoint(cli: SlurmCli, nodelist: str, port: int) -> str:
    """``ADDR:PORT`` of the first node of ``nodelist``: its ``NodeAddr`` (how Slurm itself reaches it)."""
    hosts = cli.hostnames(nodelist)
    if not hosts:
        raise SlurmError(f"slurm: empty node list {nodelist!r}")
    fields_ = dict(f.split("=", 1) for f in cli.run("scontrol", "-o", "show", "node", hosts[0]).split() if "=" in f)
    return f"{fields_.get('NodeAddr') or hosts[0]}:{port}"


def submit(spec: SlurmJobSpec, token: str, cli: SlurmCli) -> str:
    """Check the partitions, write the job's directory and ``sbatch`` the base job; its job id."""
    spec.validate()
    known = cli.partitions()
    for partition in (spec.base_partition, spec.unit_partition):
        if partition is not None and partition not in known:
            raise SlurmError(f"slurm: unknown partition {partition!r} (the cluster has {', '.join(sorted(known))})")
    prepare(spec, token)
    return cli.sbatch(base_script(spec), *spec.sbatch_options)

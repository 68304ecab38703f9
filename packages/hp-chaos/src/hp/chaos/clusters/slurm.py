"""A real Slurm on this host for tests and benches: ``munged``, ``slurmctld`` and one ``slurmd`` per fake
node (``NodeName=nK NodeHostname=localhost``, each on its own port), in a private directory.

Debian's ``slurm-wlm`` and ``munge`` (``scripts/setup.sh`` installs them when root); the daemons run as
root in the foreground, so :meth:`LocalSlurm.close` stops every one of them (and the jobs they run) even
when a test fails. Two partitions share every node: ``low`` (the default, ``PriorityTier=1``, its jobs
requeued when preempted, after ``grace_s`` with SIGTERM) and ``high`` (``PriorityTier=10``). Nodes are
whole-node allocations (``OverSubscribe=EXCLUSIVE``): a job of one partition never shares a node with
another's, so preemption is a node changing hands, as on a GPU cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from hp.chaos.clusters.slurm_accounting import Accounting
from hp.core.errors import BackendUnavailableError
from hp.core.procs import free_port, kill_tagged
from hp.core.schedulers.slurm.backend import SlurmCli, SlurmError

DAEMONS = ("munged", "slurmctld", "slurmd")
TAG = "HP_LOCAL_SLURM"  # in every daemon's environment, and so in every slurmstepd's: what close() kills


@dataclass
class LocalSlurm:
    """``nodes`` fake nodes of ``cpus`` each. Use as a context manager, or :meth:`start` / :meth:`close`."""

    nodes: int = 3
    cpus: int = 2
    memory_mb: int = 2048
    grace_s: int = 5
    slurmd_timeout_s: int = 5
    accounting: bool = False  # MariaDB + slurmdbd: QOS limits enforced (hp.chaos.clusters.slurm_accounting)
    root: str = ""
    env: dict[str, str] = field(default_factory=dict)
    _procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    def start(self, timeout_s: float = 30.0) -> LocalSlurm:
        missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
        if missing:
            raise BackendUnavailableError(f"a local Slurm needs {', '.join(missing)} (apt-get install slurm-wlm munge)")
        self.root = tempfile.mkdtemp(prefix="hp-slurm-")
        os.chmod(self.root, 0o700)
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in self.node_names)):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        try:
            self._start_munge()
            acct = Accounting(self.root) if self.accounting else None
            conf = self._write_conf(acct.conf_lines() if acct else "AccountingStorageType=accounting_storage/none\n")
            self.env = {"SLURM_CONF": conf}
            if acct:
                acct.start(self._spawn, self.cluster_name, self.cli, timeout_s)
            self._spawn("slurmctld", "-D", "-f", conf)
            for name in self.node_names:
                self._spawn("slurmd", "-D", "-f", conf, "-N", name)
            self._wait_idle(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def daemons(self) -> list[subprocess.Popen]:
        """munged, slurmctld, then each node's slurmd."""
        return list(self._procs)

    @property
    def cli(self) -> SlurmCli:
        return SlurmCli(self.env)

    def _daemon(self, name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def _spawn(self, name: str, *argv: str) -> None:
        log = open(os.path.join(self.root, "log", f"{name}-{len(self._procs)}.out"), "wb")  # noqa: SIM115
        with log:
            self._procs.append(subprocess.Popen([self._daemon(name), *argv], stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True,
                                                env={**os.environ, **self.env, TAG: self.root}))

    def _start_munge(self) -> None:
        d = os.path.join(self.root, "munge")
        with open(os.path.join(d, "munge.key"), "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(os.urandom(1024))
        self._spawn("munged", "-F", f"--key-file={d}/munge.key", f"--socket={d}/sock", f"--pid-file={d}/pid",
                    f"--log-file={d}/log", f"--seed-file={d}/seed", "--force")
        deadline = time.monotonic() + 10
        while not os.path.exists(f"{d}/sock"):
            if time.monotonic() > deadline or self._procs[-1].poll() is not None:
                raise SlurmError(f"munged did not start (see {d}/log)")
            time.sleep(0.05)

    @property
    def cluster_name(self) -> str:
        return f"hp{os.getpid()}"

    def _write_conf(self, accounting: str) -> str:
        r, ctld = self.root, free_port()
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost Port={free_port()} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
                          for n in self.node_names)
        names = ",".join(self.node_names)
        text = f"""\
ClusterName={self.cluster_name}
SlurmctldHost=localhost
SlurmctldPort={ctld}
AuthType=auth/munge
AuthInfo=socket={r}/munge/sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=1
SlurmdTimeout={self.slurmd_timeout_s}
MessageTimeout=5
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
{accounting}PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=low Nodes={names} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={self.grace_s} OverSubscribe=EXCLUSIVE MaxTime=INFINITE State=UP
PartitionName=high Nodes={names} PriorityTier=10 PreemptMode=OFF OverSubscribe=EXCLUSIVE MaxTime=INFINITE State=UP
"""
        path = os.path.join(r, "slurm.conf")
        with open(path, "w") as f:
            f.write(text)
        return path

    def _wait_idle(self, timeout_s: float) -> None:
        deadline, cli = time.monotonic() + timeout_s, self.cli
        while True:
            try:
                states = {n.name: n.state for n in cli.nodes()}
            except SlurmError:
                states = {}
            if len(states) == self.nodes and all(s == "idle" for s in states.values()):
                return
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmError(f"local Slurm not up in {timeout_s:g} s (nodes {states}, exited: {dead}; "
                                 f"logs in {self.root}/log)")
            time.sleep(0.2)

    def close(self) -> None:
        """Cancel every job, stop every daemon and job step, remove the directory. Idempotent."""
        if self.env and len(self._procs) > 1 and all(p.poll() is None for p in self._procs[:2]):
            try:
                cli = self.cli
                cli.run("scancel", "--full", "--user", str(os.getuid()))
                deadline = time.monotonic() + 10
                while [j for j in cli.jobs() if j.active] and time.monotonic() < deadline:
                    time.sleep(0.2)
            except SlurmError:
                pass
        for proc in reversed(self._procs):  # slurmd first
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._procs.clear()
        if self.root:
            kill_tagged(f"{TAG}={self.root}")  # a job step whose slurmd went first
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = ""

"""Slurm accounting for :class:`hp.chaos.clusters.slurm.LocalSlurm`: a private MariaDB and ``slurmdbd``, so
QOS limits (quotas) are real and enforced (``AccountingStorageEnforce=associations,limits,qos``).

Debian's ``mariadb-server`` and ``slurmdbd`` (``scripts/setup.sh`` installs them when root). The database
lives in the cluster's private directory, listens on a free loopback port, and is reached by ``slurmdbd``
as a user with a random password written only to ``slurmdbd.conf`` (0600, as ``slurmdbd`` requires). The
daemons are started by the caller's ``spawn(name, *argv)`` (so ``LocalSlurm.close`` stops them with the
others, ``SLURM_CONF`` in their environment), and
every job runs under one account, ``hp``, in the cluster's association tree.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from hp.core.errors import BackendUnavailableError
from hp.core.procs import free_port
from hp.core.schedulers.slurm.backend import SlurmCli, SlurmError, current_user

DAEMONS = ("mariadbd", "mariadb-install-db", "slurmdbd")
ACCOUNT = "hp"


def missing() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]


@dataclass
class Accounting:
    """The database and ``slurmdbd`` of a local cluster rooted at ``root`` (its private directory)."""

    root: str
    dbd_port: int = 0

    def conf_lines(self) -> str:
        """What ``slurm.conf`` needs to account through this ``slurmdbd`` and enforce QOS limits."""
        if not self.dbd_port:
            self.dbd_port = free_port()
        return (f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
                f"AccountingStoragePort={self.dbd_port}\nAccountingStorageEnforce=associations,limits,qos\n"
                # the munge socket for talking to slurmdbd (AuthInfo's is not used for that connection)
                f"AccountingStoragePass={self.root}/munge/sock\n")

    def start(self, spawn: Callable[..., subprocess.Popen], cluster: str, cli: SlurmCli, timeout_s: float) -> None:
        """Start MariaDB and ``slurmdbd`` (before ``slurmctld``), then register ``cluster``, the account
        ``hp`` and this user in it."""
        if gone := missing():
            raise BackendUnavailableError(f"Slurm accounting needs {', '.join(gone)} "
                                          "(apt-get install mariadb-server slurmdbd)")
        db, sql_port, password = os.path.join(self.root, "db"), free_port(), secrets.token_hex(16)
        subprocess.run([_exe("mariadb-install-db"), "--no-defaults", f"--datadir={db}", "--user=root",
                        "--auth-root-authentication-method=normal", "--skip-test-db"],
                       check=True, capture_output=True, timeout=120)
        socket = os.path.join(self.root, "db.sock")
        spawn("mariadbd", "--no-defaults", f"--datadir={db}", f"--socket={socket}", f"--port={sql_port}",
              "--bind-address=127.0.0.1", "--user=root", "--skip-name-resolve", "--innodb-buffer-pool-size=16M",
              "--innodb-log-file-size=8M", f"--pid-file={self.root}/db.pid")
        _until(lambda: _sql(socket, "SELECT 1"), timeout_s, f"MariaDB (log in {self.root}/log)")
        _sql(socket, f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
                     "GRANT ALL ON *.* TO 'slurm'@'127.0.0.1'", check=True)
        path = os.path.join(self.root, "slurmdbd.conf")  # beside slurm.conf: where slurmdbd looks
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"AuthType=auth/munge\nAuthInfo=socket={self.root}/munge/sock\nDbdHost=localhost\n"
                    f"DbdPort={self.dbd_port}\nSlurmUser=root\nLogFile={self.root}/log/slurmdbd.log\n"
                    f"PidFile={self.root}/slurmdbd.pid\nStorageType=accounting_storage/mysql\n"
                    f"StorageHost=127.0.0.1\nStoragePort={sql_port}\nStorageUser=slurm\n"
                    f"StoragePass={password}\nStorageLoc=slurm_acct\n")
        spawn("slurmdbd", "-D")
        _until(lambda: _ok(cli, "sacctmgr", "-n", "show", "cluster"), timeout_s, "slurmdbd")
        user = current_user()
        for argv in (("add", "cluster", cluster), ("add", "account", ACCOUNT, f"cluster={cluster}"),
                     ("add", "user", user, f"account={ACCOUNT}", f"cluster={cluster}")):
            cli.run("sacctmgr", "-i", *argv)


def set_qos(cli: SlurmCli, name: str, **limits: str) -> None:
    """Create QOS ``name`` if needed, set its ``limits`` (sacctmgr's names: ``MaxTRESPerUser="node=3"``,
    ``GrpTRES=...``, ``MaxJobsPerUser=...``; ``node=-1`` or ``-1`` clears one) and let this user's jobs use it."""
    if name not in cli.run("sacctmgr", "-nP", "show", "qos", "format=Name").split():
        cli.run("sacctmgr", "-i", "add", "qos", name)
    if limits:
        cli.run("sacctmgr", "-i", "modify", "qos", name, "set", *(f"{k}={v}" for k, v in limits.items()))
    cli.run("sacctmgr", "-i", "modify", "user", current_user(), "set", f"qos+={name}")


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _sql(socket: str, statement: str, check: bool = False) -> bool:
    done = subprocess.run(["mariadb", "--no-defaults", f"--socket={socket}", "-uroot", "-e", statement],
                          capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise SlurmError(f"MariaDB: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return done.returncode == 0


def _ok(cli: SlurmCli, *argv: str) -> bool:
    try:
        cli.run(*argv)
        return True
    except SlurmError:
        return False


def _until(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise SlurmError(f"{what} did not start in {timeout_s:g} s")
        time.sleep(0.1)

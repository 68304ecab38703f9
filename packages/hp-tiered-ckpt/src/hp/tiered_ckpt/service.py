"""``hp run --service ckpt``: the node checkpoint daemon, started and stopped by ``hp run``'s agent.

Each node's agent starts one daemon (``python -m hp.tiered_ckpt daemon``) bound to the node's own
address, before its workers; once every node's daemon listens, each learns the others in ring order
(node ``i`` replicates to ``i+1``, ``i+2``, ...) and every worker gets ``HP_CKPT_DAEMON`` and
``HP_CKPT_PEERS`` (and ``HP_CKPT_URL`` with ``url=``), which :meth:`TieredConfig.from_env` reads.
The daemon is a process of its own, so a worker that crashes loses nothing; it leaves with its agent
(``--parent-pid``), and its shared-memory directory is removed when the job ends: a daemon started
again does not know the files of the one before (the persistent tier is what outlives a job).

The agent generates each daemon's admin key (``secrets.token_hex(32)``) and hands it over in the
daemon's environment only (``HP_CKPT_ADMIN_KEY``; the workers' environment never holds it), so it
can send ``peers`` (which only the admin key may) as soon as the daemon listens, without reading a
file it may race with. The daemon also writes the key to ``<dir>/admin.key`` (0600, in its 0700
directory) for ``hp ckpt gc --daemon`` on that node.

Options (``--service ckpt:KEY=VALUE,...``): ``replicas`` (1), ``keep_memory`` (2), ``keep_persistent``
(3), ``port`` (0: any free port), ``dir`` (default ``/dev/shm/hp-ckpt-<uid>/<run id>/node<rank>``, 0700), ``url``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hp.core.privfs import user_dir
from hp.core.errors import UsageError
from hp.core.hookspecs import hookimpl
from hp.core.backends.api import NodeContext, ServiceError
from hp.tiered_ckpt.config import DAEMON_ENV, PEERS_ENV, URL_ENV
from hp.tiered_ckpt.wire import ADMIN_KEY_ENV

START_TIMEOUT_S = 60.0  # a cold Python start on a loaded 2-core node takes seconds
INT_OPTIONS = {"replicas": 1, "keep_memory": 2, "keep_persistent": 3, "port": 0}


def ring_peers(endpoints: list[str], me: int) -> list[str]:
    """The other nodes' daemons in ring order after node ``me``: replicas go to the first ones."""
    n = len(endpoints)
    return [endpoints[(me + k) % n] for k in range(1, n)]


@dataclass
class RunningDaemon:
    node: NodeContext
    proc: subprocess.Popen
    endpoint: str
    root: Path
    owns_root: bool  # created for this job: removed when it stops
    url: str | None
    admin_key: str = ""  # the daemon's: signs `peers` (and `gc`); never in a worker's environment
    peers: tuple[str, ...] = ()

    def connect(self, endpoints: list[str]) -> None:
        from hp.tiered_ckpt.client import DaemonClient
        from hp.tiered_ckpt.wire import parse_addr

        self.peers = tuple(ring_peers(endpoints, self.node.node_rank))
        if self.peers:
            client = DaemonClient(parse_addr(self.endpoint), self.node.token, timeout=10, admin_key=self.admin_key)
            try:
                client.set_peers(list(self.peers))
            finally:
                client.close()

    def worker_env(self) -> dict[str, str]:
        env = {DAEMON_ENV: self.endpoint, PEERS_ENV: ",".join(self.peers)}
        if self.url:
            env[URL_ENV] = self.url
        return env

    def poll(self) -> str | None:
        rc = self.proc.poll()
        if rc is None:
            return None
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        return f"checkpoint daemon at {self.endpoint} {how} (log: {self.log_path})"

    @property
    def log_path(self) -> str:
        return os.path.join(self.node.log_dir, "services", "ckpt.log")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
            try:
                self.root.parent.rmdir()  # the run's directory, once its last node's is gone
            except OSError:
                pass


@dataclass(frozen=True)
class CheckpointDaemonService:
    """The ``ckpt`` node service (family ``node_service``)."""

    name: str = "ckpt"

    def start(self, node: NodeContext) -> RunningDaemon:
        opts = dict(node.options)
        unknown = set(opts) - set(INT_OPTIONS) - {"dir", "url"}
        if unknown:
            raise UsageError(f"--service ckpt: unknown option(s) {sorted(unknown)} "
                             f"(known: {sorted([*INT_OPTIONS, 'dir', 'url'])})")
        ints = {}
        for key, default in INT_OPTIONS.items():
            try:
                ints[key] = int(opts.get(key, default))
            except ValueError:
                raise UsageError(f"--service ckpt: {key} must be an integer, got {opts[key]!r}") from None
            if ints[key] < 0:
                raise UsageError(f"--service ckpt: {key} must be >= 0, got {ints[key]}")
        owns_root = "dir" not in opts
        root = Path(opts.get("dir") or user_dir("hp-ckpt") / node.run_id / f"node{node.node_rank}")
        os.makedirs(os.path.join(node.log_dir, "services"), exist_ok=True)
        ready = Path(node.log_dir, "services", f"ckpt.node{node.node_rank}.ready")
        ready.unlink(missing_ok=True)
        log_path = os.path.join(node.log_dir, "services", "ckpt.log")
        cmd = [sys.executable, "-m", "hp.tiered_ckpt", "daemon", "--listen", f"{node.address}:{ints['port']}",
               "--dir", str(root), "--replicas", str(ints["replicas"]), "--keep-memory", str(ints["keep_memory"]),
               "--keep-persistent", str(ints["keep_persistent"]), "--ready-file", str(ready),
               "--parent-pid", str(os.getpid()), "--peers", ""]
        admin_key = secrets.token_hex(32)
        env = {**os.environ, "HP_JOB_TOKEN": node.token, ADMIN_KEY_ENV: admin_key}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        endpoint = _wait_ready(proc, ready, log_path)
        return RunningDaemon(node, proc, endpoint, root, owns_root, opts.get("url") or None, admin_key)


def _wait_ready(proc: subprocess.Popen, ready: Path, log_path: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = ready.read_text() if ready.exists() else ""
        if text.endswith("\n"):
            return text.strip()
        if proc.poll() is not None:
            tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-3:]
            raise ServiceError(f"checkpoint daemon exited with code {proc.returncode} while starting: "
                               + " | ".join(tail))
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise ServiceError(f"checkpoint daemon did not listen within {START_TIMEOUT_S:.0f} s (log: {log_path})")


@hookimpl
def hp_node_services() -> list[CheckpointDaemonService]:
    return [CheckpointDaemonService()]

"""Fixtures of hp-tiered-ckpt's tests: a real SeaweedFS S3 endpoint (one per test process), real
node daemons (``hp ckpt daemon`` subprocesses) and real multi-rank gloo workers.

Every process is started by PID and killed by PID at teardown; staging lives in a per-test
directory under /dev/shm that is removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hp.core.auth import new_token
from hp.testing import HP, free_port, wait_for
from hp.core.warm_start import python_command
from hp.tiered_ckpt.client import DaemonClient
from hp.tiered_ckpt.wire import ADMIN_KEY_FILE, read_admin_key

WORKER = Path(__file__).parent / "workers" / "ckpt_worker.py"


@pytest.fixture(scope="session")
def s3():
    from hp.tiered_ckpt.seaweed import SeaweedS3

    server = SeaweedS3().start()
    yield server
    server.stop()


@pytest.fixture
def token() -> str:
    return new_token()


@pytest.fixture
def shm():
    d = Path(tempfile.mkdtemp(prefix="hp-ckpt-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class DaemonProc:
    """One ``hp ckpt daemon`` subprocess (a "node")."""

    # the daemon's own entry point: `hp ckpt daemon` is the same code behind the full hp CLI, whose
    # start imports every installed hp plugin (seconds on a busy 2-core box); test_cli_wire starts that one
    LIGHT = [sys.executable, "-m", "hp.tiered_ckpt", "--log-level", "INFO"]
    HP_CLI = [*HP, "--log-level", "INFO", "ckpt"]

    def __init__(self, root: Path, token: str, env: dict, peers: list[str] = (), replicas: int = 1,
                 keep_memory: int = 2, cmd: list[str] = LIGHT, args: list[str] = ()) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.root = root
        self.log = open(root.with_suffix(".log"), "wb")
        self.proc = subprocess.Popen(
            [*cmd, "daemon", "--listen", self.addr, "--dir", str(root),
             "--peers", ",".join(peers), "--replicas", str(replicas), "--keep-memory", str(keep_memory), *args],
            env={**env, "HP_JOB_TOKEN": token}, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.client = DaemonClient(("127.0.0.1", self.port), token, timeout=10)
        try:
            wait_for(self._up, 60, f"daemon {self.addr}")
        except BaseException:
            self.kill()
            raise
        # the test plays the operator: its `peers` and `gc` are signed with the daemon's admin key
        self.admin_key = read_admin_key(root / ADMIN_KEY_FILE)
        self.client.admin_key = self.admin_key

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.output()
        try:
            self.client.ping()
            return True
        except OSError:
            return False

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in self.client.status()["events"] if kind is None or e["event"] == kind]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def daemons(shm, token):
    """``daemons(n, env=..., peers=...)`` starts node daemons; all are killed at teardown."""
    started: list[DaemonProc] = []

    def start(name: str = "node0", env: dict | None = None, via_hp_cli: bool = False, **kw) -> DaemonProc:
        cmd = DaemonProc.HP_CLI if via_hp_cli else DaemonProc.LIGHT
        d = DaemonProc(shm / name, token, {**os.environ, **(env or {})}, cmd=cmd, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


class Ranks:
    """``world`` real worker processes of ckpt_worker.py in one gloo group."""

    def __init__(self, world: int, args: list[str], env: dict) -> None:
        port = free_port()
        self.procs = [subprocess.Popen(
            python_command([str(WORKER), *args]),
            env={**env, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "PYTHONPATH": str(WORKER.parent)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for r in range(world)]

    def results(self, timeout: float = 180) -> list[dict]:
        out = []
        try:
            for p in self.procs:
                stdout, stderr = p.communicate(timeout=timeout)
                assert p.returncode == 0, f"worker failed ({p.returncode}):\n{stdout}\n{stderr[-4000:]}"
                out.append(json.loads(stdout.strip().splitlines()[-1]))
        finally:
            self.kill()
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()


@pytest.fixture
def ranks(token):
    """``ranks(world, args, env)`` launches workers (HP_JOB_TOKEN set); killed at teardown."""
    launched: list[Ranks] = []

    def launch(world: int, args: list[str], env: dict | None = None) -> Ranks:
        r = Ranks(world, args, {**os.environ, "HP_JOB_TOKEN": token, **(env or {})})
        launched.append(r)
        return r

    yield launch
    for r in launched:
        r.kill()

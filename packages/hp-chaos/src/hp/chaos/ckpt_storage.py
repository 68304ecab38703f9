"""Checkpoint storage for one run of a scenario job with ``job.checkpoint``: a real S3 endpoint
(SeaweedFS, :class:`hp.tiered_ckpt.seaweed.SeaweedS3`) and an ``hp ckpt daemon`` (the node memory
tier, which uploads to S3 asynchronously), both on free loopback ports in temporary directories,
both stopped by PID when the run is over, failed or not.

Each run gets its own endpoint, daemon and checkpoint namespace: a job started with a namespace
that already holds a checkpoint resumes from it instead of training from step 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

from hp.chaos.faults.storage import StorageServer
from hp.chaos.scenario import CheckpointSpec
from hp.core import auth
from hp.core.procs import HP, free_port

S3_TIMEOUT_S = "5"  # the daemon's S3 request timeout: a frozen endpoint is retried after this, not after 20 s


class CheckpointStorage:
    """``with CheckpointStorage(spec) as ck:`` → ``ck.env`` and ``ck.train_args`` for the job,
    ``ck.server`` for storage faults, ``ck.wait_persisted(step)`` afterwards."""

    def __init__(self, spec: CheckpointSpec, log_dir: str) -> None:
        self.spec, self.log_dir = spec, log_dir
        self.namespace = f"chaos-{uuid.uuid4().hex[:12]}"
        self.token = auth.new_token()
        self.s3 = None
        self.daemon: subprocess.Popen | None = None
        self.shm: str | None = None

    def start(self) -> CheckpointStorage:
        try:
            from hp.tiered_ckpt.seaweed import SeaweedS3
        except ImportError:
            raise NotImplementedError("job.checkpoint needs hp-tiered-ckpt (pip install hp-tiered-ckpt)") from None
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            self.s3 = SeaweedS3().start()
            self.url = f"s3://{self.s3.bucket}/{self.namespace}"
            self.shm = tempfile.mkdtemp(prefix="hp-chaos-ckpt-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            self.addr = f"127.0.0.1:{free_port()}"
            ready = os.path.join(self.shm, "ready")
            env = {**os.environ, **self.s3.env(), auth.TOKEN_ENV: self.token, "HP_CKPT_S3_TIMEOUT": S3_TIMEOUT_S}
            with open(os.path.join(self.log_dir, "ckpt_daemon.out"), "w") as out:
                self.daemon = subprocess.Popen(
                    [*HP, "ckpt", "daemon", "--listen", self.addr, "--dir", os.path.join(self.shm, "tier"),
                     "--replicas", "0", "--ready-file", ready],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(ready):
                if self.daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"hp ckpt daemon did not start (exit {self.daemon.poll()}); "
                                       f"see {self.log_dir}/ckpt_daemon.out")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def env(self) -> dict[str, str]:
        """For the job: the daemon, the persistent tier, S3 credentials, the token the daemon checks."""
        return {**self.s3.env(), auth.TOKEN_ENV: self.token, "HP_CKPT_DAEMON": self.addr, "HP_CKPT_URL": self.url}

    @property
    def train_args(self) -> list[str]:
        return ["--checkpoint", self.namespace, "--checkpoint-every", str(self.spec.every),
                "--checkpoint-persist-every", str(self.spec.persist_every)]

    @property
    def server(self) -> StorageServer:
        return StorageServer(self.s3.proc.pid, self.s3.ports["s3.port"])

    def _verify(self, step: int) -> tuple[bool, str]:
        """hp-tiered-ckpt's own check (`hp ckpt verify`): commit marker, sizes, per-item checksums."""
        proc = subprocess.run([*HP, "ckpt", "verify", self.namespace, "--url", self.url, "--step", str(step)],
                              env={**os.environ, **self.env}, capture_output=True, text=True, timeout=120)
        return proc.returncode == 0, (proc.stdout + proc.stderr).strip()

    def wait_persisted(self, step: int, timeout: float = 90.0) -> dict:
        """Wait (uploads are asynchronous and an outage delays them) until S3 holds a complete,
        verified checkpoint of ``step``; returns ``{"step", "ok", "waited_s", "detail"}``."""
        start = time.monotonic()
        ok, detail = self._verify(step)
        while not ok and time.monotonic() - start < timeout:
            time.sleep(1.0)
            ok, detail = self._verify(step)
        return {"step": step, "ok": ok, "waited_s": round(time.monotonic() - start, 3), "detail": detail[-500:]}

    def stop(self) -> None:
        if self.daemon is not None:
            if self.daemon.poll() is None:
                try:
                    os.killpg(self.daemon.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.daemon.wait()
        if self.s3 is not None:
            self.s3.stop()  # SIGCONT first: an outage may have left it stopped
        if self.shm:
            shutil.rmtree(self.shm, ignore_errors=True)

    def __enter__(self) -> CheckpointStorage:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

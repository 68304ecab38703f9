"""Helpers for tests that launch real ``hp`` processes (used by every hp package's tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HP = [sys.executable, "-m", "hp.core.cli"]


class Launched:
    """A real `hp ...` process in its own session, killed with its children at teardown."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [*HP, *args], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )
        self.output = ""

    def wait(self, timeout: float = 120) -> int:
        out, _ = self.proc.communicate(timeout=timeout)
        self.output += out
        return self.proc.returncode

    def stop(self, grace_s: float = 15) -> None:
        """SIGTERM (the agent forwards it to its workers), then SIGKILL of the whole group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.communicate()


def kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment holds ``tag``: workers live in sessions of their
    own, so killing the agent's process group alone could leave them behind."""
    needle = tag.encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def wait_for(predicate, timeout: float = 60, what: str = "condition") -> None:
    """Poll ``predicate`` until true; a generous bound that only catches hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def pids(tmp_path: Path, rank: int) -> list[int]:
    """PIDs recorded by the test marker worker for ``rank``, oldest first."""
    f = tmp_path / f"rank{rank}.pids"
    return [int(x) for x in f.read_text().split()] if f.exists() else []


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

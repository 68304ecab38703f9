"""Local process plumbing that hp's harnesses (chaos runs, benchmarks, the local Slurm) and tests share: the
``hp`` command of this interpreter, processes found by an environment tag, a free port, a bounded wait."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

HP = [sys.executable, "-m", "hp.core.cli"]


def tagged_pids(tag: str) -> list[int]:
    """Every live process (but this one) whose environment holds ``tag``."""
    needle, found = tag.encode() + b"\0", []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment holds ``tag``: workers live in sessions of their
    own, so killing the agent's process group alone could leave them behind."""
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 60, what: str = "condition") -> None:
    """Poll ``predicate`` until true; a generous bound that only catches hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")

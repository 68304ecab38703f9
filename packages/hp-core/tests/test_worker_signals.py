"""A worker's SIGTERM is its agent's (hp.core.worker_signals): from anyone else (Slurm signals every process
of a job step) the worker goes on, from its agent or once the agent is gone it dies of SIGTERM as before.
Real processes and real signals; this test process plays the agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

WORKER = """
import sys, time
from hp.core.worker_signals import defer_sigterm_to_agent
print(defer_sigterm_to_agent(), flush=True)
for _ in range(600):
    time.sleep(0.1)
"""


def _worker(agent_pid: int | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HP_AGENT_PID"}
    if agent_pid is not None:
        env["HP_AGENT_PID"] = str(agent_pid)
    proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.installed = proc.stdout.readline().strip() == "True"
    return proc


def _foreign_sigterm(pid: int) -> None:
    """SIGTERM from another process (as slurmstepd sends it), not from the agent."""
    subprocess.run(["kill", "-TERM", str(pid)], check=True)


def test_a_foreign_sigterm_is_left_to_the_agent_and_the_agents_own_stops_the_worker():
    w = _worker(os.getpid())
    try:
        assert w.installed
        _foreign_sigterm(w.pid)
        time.sleep(1.0)
        assert w.poll() is None, w.stderr.read()
        os.kill(w.pid, signal.SIGTERM)  # from the agent
        assert w.wait(timeout=10) == -signal.SIGTERM
        assert "left to the agent" in w.stderr.read()
    finally:
        w.kill()
        w.wait()


def test_once_the_agent_is_gone_sigterm_ends_the_worker():
    gone = subprocess.Popen(["true"])
    gone.wait()
    w = _worker(gone.pid)
    try:
        assert w.installed
        _foreign_sigterm(w.pid)
        assert w.wait(timeout=10) == -signal.SIGTERM
    finally:
        w.kill()
        w.wait()


def test_not_under_an_agent_nothing_changes():
    w = _worker(None)
    try:
        assert not w.installed
        _foreign_sigterm(w.pid)
        assert w.wait(timeout=10) == -signal.SIGTERM
    finally:
        w.kill()
        w.wait()

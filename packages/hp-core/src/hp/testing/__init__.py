"""Helpers for tests that launch real ``hp`` processes (used by every hp package's tests; no shipped module
imports them). The process plumbing that hp's harnesses also need (the ``hp`` command, processes found by their
environment tag, a free port, a bounded wait) is :mod:`hp.core.procs`, re-exported here."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hp.core.procs import HP, free_port, kill_tagged, tagged_pids, wait_for
from hp.core.warm_start import python_command

__all__ = ["HP", "Launched", "fake_kubernetes_api", "finish_when", "free_port", "kill_tagged", "listening_addresses",
           "pids", "replaced", "run_ranks", "tagged_pids", "wait_for"]

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


def replaced(raw: dict, path: str, value: Any) -> dict:
    """A deep copy of ``raw`` with the value at a dotted path (``faults.1.duration_s``) replaced;
    ``...`` deletes it. For bad-input tests of nested configs."""
    raw = copy.deepcopy(raw)
    *parents, last = path.split(".")
    node: Any = raw
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is ...:
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return raw


def finish_when(proc: subprocess.Popen, endpoint: str, token: str, done: Callable[[], bool], timeout: float,
                what: str) -> None:
    """A job that ends at a step decided at run time: wait until ``done()`` (what the test needs the job to
    have gone through), then ``hp finish`` to its controller at ``endpoint``: every rank ends after the same
    step. The job ending first is an error naming ``what``."""
    from hp.core.control_plane import request_finish

    wait_for(lambda: proc.poll() is not None or done(), timeout, what)
    if proc.poll() is not None:
        raise AssertionError(f"the job ended (exit {proc.returncode}) before {what}")
    request_finish(endpoint, token, what)


def pids(tmp_path: Path, rank: int) -> list[int]:
    """PIDs recorded by the test marker worker for ``rank``, oldest first."""
    f = tmp_path / f"rank{rank}.pids"
    return [int(x) for x in f.read_text().split()] if f.exists() else []


def run_ranks(argv: list[str], world: int, timeout_s: float, what: str, env: dict[str, str] | None = None) -> None:
    """Run ``python ARGV... RANK WORLD PORT`` as ``world`` processes (one free port for their store), each
    in its own session; raise AssertionError naming the failed ranks (with their output's tail), or when
    they do not all finish within ``timeout_s``; kill every one still running whatever happens."""
    port = free_port()
    procs = [subprocess.Popen(python_command([*argv, str(r), str(world), str(port)]), env=env or dict(os.environ),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(world)]
    try:
        deadline = time.monotonic() + timeout_s
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{what}: ranks did not finish in {timeout_s:g} s") from None
        bad = [(r, p.returncode, log[-3000:]) for r, (p, log) in enumerate(zip(procs, logs)) if p.returncode]
        assert not bad, f"{what}: ranks failed: {bad}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def listening_addresses(port: int) -> set[str]:
    """The (hex, as /proc/net/tcp writes them) local addresses a socket listens on at ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # 0A: LISTEN
                found.add(addr)
    return found


@contextlib.contextmanager
def fake_kubernetes_api(handler: type, folder: Path, token: str = "test-token") -> Iterator[str]:
    """Serve ``handler`` (an ``http.server`` request handler standing in for a Kubernetes API server, which
    cannot run here) on a free loopback port; yields the path of a kubeconfig naming it with a bearer
    ``token``. The server is stopped on exit, however the test ends."""
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    kubeconfig = folder / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    try:
        yield str(kubeconfig)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

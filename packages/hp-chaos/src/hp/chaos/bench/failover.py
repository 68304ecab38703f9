"""Controller failover time: how long a job is without a controller when the leader's process dies.

Two ``hp controller --store etcd`` replicas of one job run on a real etcd (:mod:`hp.core.leader`); an
agent-like client has joined (the job is running). The leader is SIGKILLed; the clock starts at the
kill and stops when the client's next request (a heartbeat, following the leader as an agent does,
:class:`hp.core.leader.LeaderResolver`) is answered by the standby with the job's state intact. The
split: ``elected_s`` (the standby's ``controller_elected`` decision, wall clock, in the job's decision
log in etcd) and the rest (the client finding and reaching it). The lease TTL bounds the first part:
etcd expires a key between TTL and TTL + its ~0.5 s expiry tick after the last refresh, which itself
was up to TTL/3 before the kill.

Used by ``hp bench init`` (its ``failover_s``) and the HA tests (:class:`ReplicaSet`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from datetime import timedelta
from typing import Any

from hp.core import auth
from hp.core.procs import HP, free_port


class ReplicaSet:
    """``n`` ``hp controller --store etcd`` replicas of one new job, each on its own port (which names it)."""

    def __init__(self, etcd_endpoint: str, token: str, n: int = 2, nnodes: int = 1, lease_s: int = 2,
                 log_dir: str | None = None, host: str = "127.0.0.1") -> None:
        from hp.core.leader import LeaderResolver
        from hp.core.plugins import get_backend

        self.job, self.token = uuid.uuid4().hex, token
        env = {**os.environ, auth.TOKEN_ENV: token}
        self.ports = [free_port(host) for _ in range(n)]
        self.procs = []
        for i, port in enumerate(self.ports):
            log = ["--decision-log", os.path.join(log_dir, f"decisions{i}.jsonl")] if log_dir else []
            self.procs.append(subprocess.Popen(
                [*HP, "controller", "--store", "etcd", "--rdzv-endpoint", etcd_endpoint, "--run-id", self.job,
                 "--nnodes", str(nnodes), "--host", host, "--port", str(port), "--lease", str(lease_s),
                 "--heartbeat-timeout", "60", *log],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        self.store = get_backend("store", "etcd").connect(etcd_endpoint, 2379, timedelta(seconds=10), job=self.job)
        self.resolver = LeaderResolver(self.store, token)

    def leader(self, timeout: float = 60) -> str:
        endpoint = self.resolver.wait_for_other("", time.monotonic() + timeout)
        if endpoint is None:
            raise RuntimeError(f"no replica was elected within {timeout:g} s ({self.status()})")
        return endpoint

    def process_of(self, endpoint: str) -> subprocess.Popen:
        return self.procs[self.ports.index(int(endpoint.rpartition(":")[2]))]

    def status(self) -> str:
        return ", ".join(f"replica on port {port}: rc {p.poll()}" for port, p in zip(self.ports, self.procs))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def one_failover(etcd_endpoint: str, lease_s: int) -> dict[str, Any]:
    """One kill of a leader; the seconds until the standby answered, and until it was elected."""
    from hp.core.control_plane import ControlClient
    from hp.core.leader import StateKeeper

    token = auth.new_token()
    with ReplicaSet(etcd_endpoint, token, lease_s=lease_s) as replicas:
        client = ControlClient(replicas.leader(), token, node=0, follow=replicas.resolver.wait_for_other,
                               timeout_s=60)
        client.call("join", {"node_rank": 0, "nproc": 8, "host": "bench", "spares": 1})
        for _ in range(3):  # the lease is refreshed a few times: the kill lands anywhere in its period
            client.call("heartbeat", {"node_rank": 0, "generation": 1})
            time.sleep(lease_s / 3)
        before = client.call("state", {})
        killed_wall, killed = time.time(), time.monotonic()
        replicas.process_of(client.endpoint).kill()
        beat = client.call("heartbeat", {"node_rank": 0, "generation": 1})
        answered = time.monotonic() - killed
        after = client.call("state", {})
        intact = ({k: v for k, v in before.items() if k != "decisions"}
                  == {k: v for k, v in after.items() if k != "decisions"}) and beat["generation"] == 1
        elected = [d["t"] for d in StateKeeper(replicas.store, token, 0).decisions()
                   if d.get("decision") == "controller_elected" and d["t"] >= killed_wall]
    return {"failover_s": answered, "elected_s": (min(elected) - killed_wall) if elected else None,
            "state_intact": intact}


def measure(etcd_endpoint: str, repeats: int = 5, lease_s: int = 2, log=print) -> dict[str, Any]:
    from hp.chaos.bench.meta import spread

    samples = []
    for i in range(repeats):
        s = one_failover(etcd_endpoint, lease_s)
        samples.append(s)
        elected = f"{s['elected_s']:.3f} s" if s["elected_s"] is not None else "unknown"
        log(f"hp bench init: failover {i + 1}/{repeats}: answered after {s['failover_s']:.3f} s "
            f"(standby elected after {elected}){'' if s['state_intact'] else ', STATE LOST'}")
    return {
        "definition": "seconds from SIGKILL of the leading `hp controller --store etcd` replica until a client "
                      "following the leader (as agents do) gets its next request answered by the standby, the job's "
                      "state intact; median of the repeats",
        "lease_s": lease_s,
        "failover": spread([s["failover_s"] for s in samples]),
        "elected": spread([s["elected_s"] for s in samples if s["elected_s"] is not None]),
        "state_intact": all(s["state_intact"] for s in samples),
        "samples": samples,
    }

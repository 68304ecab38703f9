"""The HA controller on a real etcd (hp.core.leader): the lease, fenced state writes, and `hp controller`
replicas handing a job over when the leader is SIGKILLed or frozen past its lease.

Each xdist worker starts its own etcd once per module; it and every replica are stopped whatever the
tests do."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from datetime import timedelta

import pytest

from hp.chaos.bench.failover import ReplicaSet
from hp.core import etcd_store, get_backend
from hp.core.control_plane import ControlClient
from hp.core.errors import ControlPlaneError
from hp.core.leader import Deposed, LeaderResolver, Lease, StateKeeper

etcd_store.etcd_binary()  # a missing etcd fails these tests (scripts/setup.sh installs it)
TOKEN = "t" * 40


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    server = etcd_store.EtcdServer("127.0.0.1", workdir=str(tmp_path_factory.mktemp("etcd")), die_with_parent=True)
    try:
        yield server.start()
    finally:
        server.stop()


def job_store(server, job: str):
    return get_backend("store", "etcd").connect(server.host, server.port, timedelta(seconds=5), job=job)


def test_one_candidate_holds_the_lease_until_it_releases_it_or_stops_refreshing(etcd_server):
    job = uuid.uuid4().hex
    a, b = (Lease(job_store(etcd_server, job), name, ttl_s=1) for name in ("a", "b"))
    assert a.try_acquire() and not b.try_acquire()
    assert a.refresh() and a.epoch > 0
    a.release()
    assert b.try_acquire() and b.epoch > 0
    stop = threading.Event()
    started = time.monotonic()
    assert a.acquire(stop)  # b never refreshes: its key expires, a's watch sees it go
    assert time.monotonic() - started < 10
    assert a.epoch > b.epoch  # epochs only grow
    assert not b.refresh()  # b lost it: it must not believe it still leads


def test_state_writes_are_fenced_a_deposed_leader_cannot_overwrite_the_new_ones(etcd_server):
    job = uuid.uuid4().hex
    old = StateKeeper(job_store(etcd_server, job), TOKEN, epoch=1)
    assert old.read() is None
    old.persist({"generation": 1}, [{"decision": "join"}])
    new = StateKeeper(job_store(etcd_server, job), TOKEN, epoch=2)
    assert new.read() == {"generation": 1}
    new.persist({"generation": 1, "by": "new"}, [{"decision": "controller_elected"}])  # the takeover write
    with pytest.raises(Deposed, match="another controller wrote"):
        old.persist({"generation": 2}, [])
    assert StateKeeper(job_store(etcd_server, job), TOKEN, epoch=3).read() == {"generation": 1, "by": "new"}
    assert [d["decision"] for d in new.decisions()] == ["join", "controller_elected"]


def test_a_forged_state_in_etcd_is_never_taken_over(etcd_server):
    job = uuid.uuid4().hex
    store = job_store(etcd_server, job)
    keeper = StateKeeper(store, TOKEN, epoch=1)
    store.client.write(keeper.path, json.dumps({"epoch": 1, "state": {"generation": 99}}))  # no token: unsealed
    with pytest.raises(Deposed, match="not sealed with this job's token"):
        keeper.read()
    other = StateKeeper(store, "u" * 40, epoch=1)  # sealed with another job's token
    store.client.delete(keeper.path)
    other.read()
    other.persist({"generation": 5}, [])
    with pytest.raises(Deposed, match="not sealed"):
        keeper.read()


@pytest.fixture
def replicas(etcd_server, tmp_path):
    with ReplicaSet(etcd_server.endpoint, TOKEN, lease_s=1, log_dir=str(tmp_path)) as r:
        yield r


def test_a_replica_takes_the_job_over_when_the_leader_is_sigkilled(replicas):
    client = ControlClient(replicas.leader(), TOKEN, node=0, follow=replicas.resolver.wait_for_other, timeout_s=20)
    client.call("join", {"node_rank": 0, "nproc": 2, "host": "h0", "spares": 1})
    before = client.call("state", {})
    assert before["state"] == "running" and before["generation"] == 1
    first = client.endpoint
    replicas.process_of(first).kill()
    killed = time.monotonic()
    beat = client.call("heartbeat", {"node_rank": 0, "generation": 1})  # follows to the standby
    failover = time.monotonic() - killed
    assert client.endpoint != first
    assert beat["state"] == "running" and beat["generation"] == 1
    after = client.call("state", {})
    assert {k: v for k, v in after.items() if k != "decisions"} == {k: v for k, v in before.items() if k != "decisions"}
    assert failover < 15, f"failover took {failover:.1f} s (lease 1 s)"
    # and it goes on deciding: the rank's failure is fenced by the holder the old leader recorded
    d = client.call("worker_failed", {"node_rank": 0, "generation": 1, "rank": 1, "holder": "r1.0", "signal": "SIGKILL"})
    assert d["action"] == "promote_spare" and d["generation"] == 2


def test_a_frozen_leader_that_wakes_after_a_takeover_answers_nothing(replicas):
    client = ControlClient(replicas.leader(), TOKEN, node=0, follow=replicas.resolver.wait_for_other, timeout_s=20)
    client.call("join", {"node_rank": 0, "nproc": 2, "host": "h0", "spares": 1})
    old_endpoint = client.endpoint
    old = replicas.process_of(old_endpoint).pid
    os.kill(old, signal.SIGSTOP)  # a stalled leader: its lease runs out while it is frozen
    try:
        client.call("heartbeat", {"node_rank": 0, "generation": 1})
        assert client.endpoint != old_endpoint
    finally:
        os.kill(old, signal.SIGCONT)
    d = client.call("worker_failed", {"node_rank": 0, "generation": 1, "rank": 1, "holder": "r1.0", "signal": "SIGKILL"})
    assert d["generation"] == 2
    stale = ControlClient(old_endpoint, TOKEN, node=0, timeout_s=3)  # straight at the old leader, no following
    deadline = time.monotonic() + 10
    while True:  # it may answer a read for the instant before it notices; never a decision
        with pytest.raises(ControlPlaneError) as e:
            stale.call("worker_failed", {"node_rank": 0, "generation": 2, "rank": 0, "holder": "r0.0", "signal": "SIGKILL"})
        if e.value.status in (0, 503) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert e.value.status in (0, 503), e.value
    assert client.call("state", {})["generation"] == 2  # the new leader's job: nothing the old one did counts


def test_the_packed_state_round_trips_and_a_bomb_is_refused():
    import base64
    import zlib

    from hp.core import leader

    doc = {"epoch": 3, "state": {"holders": [[r, f"r{r}.0"] for r in range(16384)]}}
    packed = leader._pack(doc)
    assert leader._unpack(packed) == doc and len(packed) < len(json.dumps(doc)) / 2
    bomb = "z1:" + base64.b64encode(zlib.compress(b"0" * (leader.MAX_STATE_BYTES + 1), 9)).decode()
    with pytest.raises(ValueError, match="inflates past"):
        leader._unpack(bomb)
    with pytest.raises(ValueError, match="not a packed"):
        leader._unpack(json.dumps(doc))


def test_a_rendezvous_survives_a_takeover_its_nodes_join_the_new_leader(etcd_server, tmp_path):
    """The rendezvous is not persisted (each join would rewrite the whole state): a node that joined the
    old leader is not a member at the new one (403), joins again (as hp run's agent does), and the
    rendezvous completes there."""
    with ReplicaSet(etcd_server.endpoint, TOKEN, nnodes=2, lease_s=1, log_dir=str(tmp_path)) as replicas:
        client = ControlClient(replicas.leader(), TOKEN, node=0, follow=replicas.resolver.wait_for_other, timeout_s=20)
        join0 = {"node_rank": 0, "nproc": 1, "host": "h0", "spares": 1}
        client.call("join", join0)
        assert client.call("rendezvous", {"node_rank": 0})["state"] == "rendezvous"
        replicas.process_of(client.endpoint).kill()
        with pytest.raises(ControlPlaneError) as e:
            client.call("rendezvous", {"node_rank": 0})  # follows to the standby, which never saw node 0
        assert e.value.status == 403
        client.call("join", join0)
        other = ControlClient(client.endpoint, TOKEN, node=1, timeout_s=20)
        other.call("join", {"node_rank": 1, "nproc": 1, "host": "h1", "spares": 1})
        a = client.call("rendezvous", {"node_rank": 0})
        assert a["state"] == "running" and a["generation"] == 1 and a["world_size"] == 2


def test_hp_run_agents_join_again_when_the_controller_moves_during_the_rendezvous(etcd_server, tmp_path):
    """A standalone replica leads while node 0's agent joins; it is SIGKILLed before node 1 arrives. Node 0's
    own replica takes over without node 0 in its state: the agent is told it is not a member, joins
    again, and the job runs once node 1 joins."""
    import subprocess
    from pathlib import Path

    from hp.core.auth import TOKEN_ENV
    from hp.testing import HP, wait_for

    worker = Path(__file__).parent / "workers" / "allreduce_worker.py"
    with ReplicaSet(etcd_server.endpoint, TOKEN, n=1, nnodes=2, lease_s=1) as standalone:
        first = standalone.leader()
        env = {**os.environ, TOKEN_ENV: TOKEN, "HP_TEST_DIR": str(tmp_path)}

        def agent(node: int) -> subprocess.Popen:
            return subprocess.Popen(
                [*HP, "run", "--store", "etcd", "--rdzv-endpoint", etcd_server.endpoint, "--run-id", standalone.job,
                 "--nnodes", "2", "--node-rank", str(node), "--controller-lease", "1", "--heartbeat-timeout", "10",
                 "--log-dir", str(tmp_path / f"n{node}"), str(worker)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

        agents = [agent(0)]
        try:
            probe = ControlClient(first, TOKEN, timeout_s=5)
            wait_for(lambda: "0" in probe.call("state", {})["nodes"], 60, "node 0 joining the standalone leader")
            standalone.process_of(first).kill()
            agents.append(agent(1))
            outputs = [a.communicate(timeout=120)[0] for a in agents]
        finally:
            for a in agents:
                if a.poll() is None:
                    os.killpg(a.pid, signal.SIGKILL)
                    a.wait()
        assert [a.returncode for a in agents] == [0, 0], outputs
        assert "joining its new leader" in outputs[0], outputs[0][-2000:]
        sums = sorted((tmp_path / f"rank{r}.sum").read_text().split()[:2] for r in (0, 1))
        assert sums == [["1.0", "2"], ["1.0", "2"]]

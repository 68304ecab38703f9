"""The per-node relay of the membership (hp.core.fanout, issue #14), against a real TCPStore: what the
controller publishes reaches the node's mirrors with blocking waits only, sealed bytes pass unchanged,
a store that times out or fails is ridden out, and stopping leaves no thread, socket or directory."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hp.chaos.bench.control_nodes import counting
from hp.core import fanout
from hp.core.fanout import DIR_PREFIX, KEEP_PLANS, Channel, Mirror, Relay, forwarded, sweep_stale
from hp.core.protocol import (
    ARRIVE_OUTCOME, GENERATION_KEY, STATE_NBYTES_KEY, ArriveOutcome, Plan, SpareAssignment, arrive_prefix, plan_key,
    spare_key,
)
from hp.core.signed_values import seal, sealing, unseal
from hp.testing import wait_for

TOKEN = "e" * 64


@pytest.fixture
def store():
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _client(store) -> dist.Store:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))


def _plan(generation: int, holders: dict[int, str] | None = None) -> Plan:
    return Plan(generation, 2, "running", "", holders or {0: "r0.0", 1: "r1.0"})


def _publish(store, generation: int, holders: dict[int, str] | None = None) -> Plan:
    """What the controller does: the plan, then the generation, sealed."""
    publish, plan = sealing(store.set, TOKEN), _plan(generation, holders)
    publish(plan_key(generation), plan.to_json())
    publish(GENERATION_KEY, str(generation))
    return plan


@pytest.fixture
def relay(store):
    clients: list = []

    def connect():
        client = counting(_client(store))
        client.asked = []  # the keys it was asked to get or wait for, in order
        get, wait = client.get, client.wait
        client.get = lambda key: client.asked.append(key) or get(key)
        client.wait = lambda keys, *timeout: client.asked.extend(keys) or wait(keys, *timeout)
        clients.append(client)
        return client

    relay = Relay(connect, TOKEN, node_rank=0, wait_s=0.3, log=lambda m: None).start()
    relay.clients = clients
    yield relay
    relay.stop(timeout_s=5)


def test_a_new_generation_reaches_every_mirror_sealed_as_published(store, relay):
    mirrors = [Mirror(relay.channel.path) for _ in range(4)]
    plan = _publish(store, 1)
    for m in mirrors:
        wait_for(lambda m=m: m.get(plan_key(1)) is not None, 10, "plan 1")
        assert m.get(plan_key(1)) == store.get(plan_key(1))  # the sealed bytes, unchanged
        assert Plan.from_json(unseal(TOKEN, plan_key(1), m.get(plan_key(1)))) == plan
    version = mirrors[0].version
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(mirrors[0].wait(version, 10)))
    waiter.start()
    _publish(store, 2)
    waiter.join(10)
    assert woke and woke[0] > version  # woken by the change, not by the timeout
    for m in mirrors:
        wait_for(lambda m=m: m.get(plan_key(2)) is not None, 10, "plan 2")
        assert m.get(GENERATION_KEY) is None  # the plans are the generation: the channel lists them
        m.close()


def test_only_the_newest_plans_stay_in_the_channel(store, relay):
    mirror = Mirror(relay.channel.path)
    for g in range(1, KEEP_PLANS + 3):
        _publish(store, g)
    wait_for(lambda: mirror.get(plan_key(KEEP_PLANS + 2)) is not None, 10, "the last plan")
    wait_for(lambda: sorted(mirror.keys("hp/plan/")) == sorted(plan_key(g) for g in range(3, KEEP_PLANS + 3)),
             10, "old plans removed")
    late = Mirror(relay.channel.path)  # a process that starts now gets the same snapshot
    assert sorted(late.keys()) == sorted(mirror.keys())
    mirror.close()
    late.close()


def test_at_idle_the_relay_blocks_and_rides_out_store_timeouts(store, relay):
    _publish(store, 1)
    mirror = Mirror(relay.channel.path)
    wait_for(lambda: mirror.get(plan_key(1)) is not None, 10, "plan 1")
    before = sum(c.requests for c in relay.clients)
    threading.Event().wait(1.5)  # five expiries of the relay's 0.3 s wait
    idle = sum(c.requests for c in relay.clients) - before
    assert idle <= 5 + 2  # one blocking get per expiry: no polling
    _publish(store, 2)
    wait_for(lambda: mirror.get(plan_key(2)) is not None, 10, "plan 2 after the timeouts")
    mirror.close()


def test_a_failing_store_is_connected_again(store):
    calls = []

    def connect():
        calls.append(1)
        if len(calls) <= 4:
            raise ConnectionRefusedError("the store's host is restarting")
        return _client(store)

    said = []
    relay = Relay(connect, TOKEN, node_rank=0, wait_s=0.3, log=said.append).start()
    try:
        mirror = Mirror(relay.channel.path)
        _publish(store, 1)
        wait_for(lambda: mirror.get(plan_key(1)) is not None, 10, "plan 1 after a reconnect")
        assert len(calls) == 5 and len(said) == 1 and "ConnectionRefusedError" in said[0]  # said once it lasted
        mirror.close()
    finally:
        relay.stop(timeout_s=5)


def test_a_forged_plan_in_the_store_is_passed_on_but_never_skips_the_genuine_one(store, relay):
    mirror = Mirror(relay.channel.path)
    forged = seal("f" * 64, plan_key(1), _plan(1).to_json()).encode()
    store.set(plan_key(1), forged)
    wait_for(lambda: mirror.get(plan_key(1)) == forged, 10, "the forged plan, unchanged")  # workers refuse it
    plan = _publish(store, 1)
    wait_for(lambda: mirror.get(plan_key(1)) != forged, 10, "the genuine plan")
    assert Plan.from_json(unseal(TOKEN, plan_key(1), mirror.get(plan_key(1)))) == plan
    _publish(store, 2)
    wait_for(lambda: mirror.get(plan_key(2)) is not None, 10, "the next plan")
    mirror.close()


def test_a_promoted_spare_of_this_node_gets_its_assignment(store, relay):
    mirror = Mirror(relay.channel.path)
    _publish(store, 1)
    store.set(spare_key("n0s0"), SpareAssignment(0, 1).to_json())  # forged, before the genuine one
    _publish(store, 2, {0: "r0.0", 1: "spare.n0s0", 2: "spare.n1s0"})  # n1s0 is another node's spare
    sealing(store.set, TOKEN)(spare_key("n1s0"), SpareAssignment(2, 2).to_json())
    genuine = SpareAssignment(1, 2)
    sealing(store.set, TOKEN)(spare_key("n0s0"), genuine.to_json())
    wait_for(lambda: (mirror.get(spare_key("n0s0")) or b"").startswith(b"{\"v\""), 10, "the genuine assignment")
    assert SpareAssignment.from_json(unseal(TOKEN, spare_key("n0s0"), mirror.get(spare_key("n0s0")))) == genuine
    assert mirror.get(spare_key("n1s0")) is None and mirror.get(STATE_NBYTES_KEY) is None
    # later plans still name it: its assignment is not read again
    before, asked = sum(c.requests for c in relay.clients), {id(c): len(c.asked) for c in relay.clients}
    assert spare_key("n0s0") in [k for c in relay.clients for k in c.asked]  # read until the genuine one came
    started = time.monotonic()
    _publish(store, 3, {0: "r0.0", 1: "spare.n0s0", 2: "spare.n1s0"})
    wait_for(lambda: mirror.get(plan_key(3)) is not None, 10, "plan 3")
    threading.Event().wait(0.5)
    # get plan 3, end barrier 2, get plan 4, and one blocking get more per expiry of the relay's 0.3 s wait
    # (a loaded machine stretches the window: seen 4 requests in a run of 80 min)
    expiries = int((time.monotonic() - started) / 0.3) + 1
    assert sum(c.requests for c in relay.clients) - before <= 3 + expiries
    assert spare_key("n0s0") not in [k for c in relay.clients for k in c.asked[asked.get(id(c), 0):]]
    mirror.close()


def test_a_new_plan_abandons_the_superseded_arrival_barrier(store, relay):
    barrier = dist.PrefixStore(arrive_prefix(1), _client(store))
    _publish(store, 1)
    barrier.compare_set(ARRIVE_OUTCOME, "", ArriveOutcome.FORMED.value)  # generation 1 formed
    _publish(store, 2)
    _publish(store, 3)  # generation 2 never formed: ranks still arriving in it wake
    wait_for(lambda: dist.PrefixStore(arrive_prefix(2), store).check([ARRIVE_OUTCOME]), 10, "barrier 2 ended")
    assert dist.PrefixStore(arrive_prefix(2), store).get(ARRIVE_OUTCOME) == b"abandoned"
    assert barrier.get(ARRIVE_OUTCOME) == b"formed"  # decided once


def test_stopping_leaves_no_thread_socket_or_directory(store):
    before = {t.name for t in threading.enumerate()}
    relay = Relay(lambda: _client(store), TOKEN, node_rank=0, wait_s=0.2, log=lambda m: None).start()
    mirror = Mirror(relay.channel.path)
    path = relay.channel.path
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700  # this user's processes only
    relay.stop(timeout_s=5)
    assert not os.path.exists(os.path.dirname(path))
    wait_for(lambda: mirror._sock is None, 10, "the mirror to see the channel go")  # it retries, quietly
    mirror.close()
    wait_for(lambda: not {t.name for t in threading.enumerate() if t.name.startswith("hp-fanout")} - before, 10,
             "every relay, acceptor and mirror thread to end")
    with pytest.raises(OSError):
        Mirror(path)


def test_a_stopped_relay_leaves_its_store_read_within_the_wait_an_exiting_agent_gives_it(store):
    """An agent joins its relay's thread before it exits (RELAY_WAIT_S + 1): a daemon thread still inside
    torch's C++ store read when the interpreter finalizes is killed mid-call (std::terminate, exit -6)."""
    assert fanout.RELAY_WAIT_S <= 5.0  # what every exiting agent may wait for it
    clients = []
    relay = Relay(lambda: clients.append(counting(_client(store))) or clients[-1], TOKEN, node_rank=0,
                  log=lambda m: None).start()  # the default wait
    wait_for(lambda: clients and clients[0].requests >= 1, 10, "the relay's first read")
    time.sleep(0.2)  # blocked in its read of plan 1, which nobody publishes
    started = time.monotonic()
    relay.stop(timeout_s=fanout.RELAY_WAIT_S + 1.0)
    assert not relay._thread.is_alive() and time.monotonic() - started <= fanout.RELAY_WAIT_S + 1.0


def test_a_mirror_that_lost_its_connection_resyncs():
    channel = Channel()
    try:
        mirror = Mirror(channel.path)
        channel.update({"hp/plan/1": b"x"})
        wait_for(lambda: mirror.get("hp/plan/1") == b"x", 10, "a value")
        mirror._sock.shutdown(socket.SHUT_RDWR)  # as if the connection broke
        channel.update({"hp/plan/2": b"y", "hp/plan/1": None})
        wait_for(lambda: mirror.get("hp/plan/2") == b"y" and mirror.get("hp/plan/1") is None, 10, "the resync")
        mirror.close()
    finally:
        channel.close()


def test_a_store_value_over_the_bound_is_not_forwarded(store, relay, monkeypatch):
    monkeypatch.setattr(fanout, "MAX_VALUE_BYTES", 4096)
    mirror = Mirror(relay.channel.path)
    store.set(plan_key(1), b"x" * 5000)  # a store writer without the token, at the key the relay waits on
    threading.Event().wait(0.5)
    assert mirror.get(plan_key(1)) is None
    plan = _publish(store, 1)
    wait_for(lambda: mirror.get(plan_key(1)) is not None, 10, "the genuine plan")
    assert Plan.from_json(unseal(TOKEN, plan_key(1), mirror.get(plan_key(1)))) == plan
    mirror.close()


def test_a_mirror_drops_a_frame_over_the_bound_and_connects_again(tmp_path):
    path = str(tmp_path / "channel.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    server.settimeout(10)
    accepted = []

    def serve():
        for _ in range(2):
            conn, _ = server.accept()
            accepted.append(conn)
            conn.sendall(fanout._frame("", b""))  # in sync
            if len(accepted) == 1:  # then a frame that claims 1 GiB
                conn.sendall(fanout._HEADER.pack(9, 1 << 30) + b"hp/plan/1" + b"x" * 100)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    mirror = Mirror(path, retry_s=0.05)
    try:
        wait_for(lambda: len(accepted) == 2, 10, "the mirror to connect again")
        assert mirror.get(plan_key(1)) is None
    finally:
        mirror.close()
        server.close()
        for conn in accepted:
            conn.close()


def test_a_killed_agents_channel_directory_is_swept_by_the_next(tmp_path):
    def channel_dir(name: str):
        path = tmp_path / f"{DIR_PREFIX}{name}"
        path.mkdir(mode=0o700)
        return path

    def age(path, age_s: float = 120.0):
        os.utime(path, (time.time() - age_s, time.time() - age_s))

    dead, live, unbound, fresh = (channel_dir(n) for n in ("dead", "live", "unbound", "fresh"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(dead / "channel.sock"))  # bound, then its process gone: connections are refused
    sock.close()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(live / "channel.sock"))
    listening.listen(1)
    other = tmp_path / "not-a-channel"
    other.mkdir()
    for path in (dead, live, unbound, other):
        age(path)
    fresh_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fresh_sock.bind(str(fresh / "channel.sock"))  # bound a moment ago, not listening yet
    try:
        assert sorted(sweep_stale(str(tmp_path))) == sorted([str(dead), str(unbound)])
        assert live.exists() and fresh.exists() and other.exists()
    finally:
        listening.close()
        fresh_sock.close()


def test_only_the_membership_is_forwarded():
    assert forwarded(plan_key(3)) and forwarded(spare_key("n0s1"))
    assert not forwarded(GENERATION_KEY) and not forwarded(STATE_NBYTES_KEY)
    assert not forwarded(arrive_prefix(1) + "count")


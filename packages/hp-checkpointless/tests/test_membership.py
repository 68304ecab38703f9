"""The worker's watch threads (heartbeat and generation watch), against a real TCPStore client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import threading

import pytest
import torch.distributed as dist

from hp.chaos.bench.control_nodes import counting
from hp.checkpointless.membership import (
    JobFinished, JobView, Superseded, Watch, arrive, wait_for_assignment, wait_for_generation,
)
from hp.core.fanout import Mirror, Relay
from hp.core.protocol import (
    FINISHED_KEY, GENERATION_KEY, STATE_NBYTES_KEY, Plan, SpareAssignment, arrive_prefix, plan_key, spare_key,
)
from hp.core.signed_values import Refusals, seal, sealing
from hp.testing import wait_for


def test_the_heartbeat_goes_on_while_the_store_does_not_answer(tmp_path):
    # a listener that never accepts: the kernel completes the handshake, nothing ever answers
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    heartbeat = tmp_path / "beat"
    seen = []
    watch = Watch(lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3)),
                  str(heartbeat), seen.append, beat_every_s=0.05, token="t" * 64).start()
    try:
        first = os.stat(heartbeat).st_mtime_ns
        time.sleep(1.0)
        assert os.stat(heartbeat).st_mtime_ns > first  # beaten by now, although the store read blocks
        assert seen == []  # and no generation was ever read
    finally:
        watch.stop()
        silent.close()
    assert not heartbeat.exists()  # a process that left the step loop is no longer watched for hangs


def test_membership_reads_the_protocol_without_the_controller():
    code = "import hp.checkpointless.membership, sys; assert 'hp.core.controller' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- forged store values (issue #14): readers against a real TCPStore --------------------------
TOKEN = "c" * 64


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server


def _plan(generation: int, world: int = 2, **kw) -> Plan:
    return Plan(generation, world, kw.pop("state", "running"), "", {r: f"r{r}.0" for r in range(world)}, **kw)


def _publish(store, generation: int, number: bool = True, **kw) -> Plan:
    """What the controller does: the plan of ``generation``, then its number, sealed."""
    publish, plan = sealing(store.set, TOKEN), _plan(generation, **kw)
    publish(plan_key(generation), plan.to_json())
    if number:
        publish(GENERATION_KEY, str(generation))
    return plan


FORGED = ["99", seal("d" * 64, GENERATION_KEY, "99"), seal(TOKEN, plan_key(99), "99"),
          seal(TOKEN, STATE_NBYTES_KEY, "99")]  # unsealed, another token, moved from other keys


def test_a_forged_generation_is_ignored_and_the_plans_stand_in_for_it(store):
    said = []
    view = JobView(store, TOKEN, Refusals(lambda key, message: said.append(message)))
    _publish(store, 1)
    assert view.generation() == 1
    for forged in FORGED:
        store.set(GENERATION_KEY, forged)
        assert view.generation() == 1
    assert view.refusals.count == len(FORGED) and len(said) == 1 and "'hp/generation'" in said[0]  # rate limited
    _publish(store, 2, number=False)  # the controller's next plan; the key stays forged
    assert view.generation() == 2 and view.plan(2) == _plan(2)
    _publish(store, 3, number=False)
    _publish(store, 4, number=False)
    assert view.generation() == 4  # every genuine plan from there on


def test_a_replayed_older_generation_never_takes_a_reader_back(store):
    old = seal(TOKEN, GENERATION_KEY, "1")
    _publish(store, 1)
    _publish(store, 2)
    view = JobView(store, TOKEN)
    assert view.generation() == 2
    store.set(GENERATION_KEY, old)  # a genuine value of the past, written again
    assert view.generation() == 2
    # a fresh reader that knows generation 2 is due (a promoted spare's assignment) finds it by its plan
    assert JobView(store, TOKEN).generation(expected=2) == 2
    assert wait_for_generation(JobView(store, TOKEN), 2, timeout_s=5) == _plan(2)


def test_a_forged_plan_is_never_adopted(store):
    _publish(store, 1)
    view = JobView(store, TOKEN)
    fenced = Plan(2, 1, "failed", "forged", {0: "evil"}).to_json()
    for forged in (fenced, seal("d" * 64, plan_key(2), fenced), seal(TOKEN, plan_key(3), fenced),
                   seal(TOKEN, plan_key(1), _plan(1).to_json())):  # plan 1, genuinely sealed, moved to 2
        store.set(plan_key(2), forged)
        store.set(GENERATION_KEY, seal(TOKEN, GENERATION_KEY, "2"))  # even under a genuine number
        with pytest.raises(TimeoutError):
            wait_for_generation(view, 2, poll_s=0.01, timeout_s=0.1)
        assert view.plan(2) is None
    plan = _publish(store, 2, state="failed")  # the controller's own, written over the forgery
    assert wait_for_generation(view, 2, timeout_s=5) == plan


def test_a_spare_ignores_a_forged_assignment_and_takes_the_genuine_one(store):
    key, got = spare_key("n0s0"), []
    store.set(key, SpareAssignment(0, 1).to_json())  # unsealed: would make the spare rank 0 of generation 1
    waiter = threading.Thread(target=lambda: got.append(wait_for_assignment(JobView(store, TOKEN), "n0s0")))
    waiter.start()
    time.sleep(0.2)
    store.set(key, seal("d" * 64, key, SpareAssignment(2, 1).to_json()))
    time.sleep(0.2)
    assert got == []
    sealing(store.set, TOKEN)(key, SpareAssignment(1, 2).to_json())
    waiter.join(10)
    assert got == [(1, 2)]


def test_a_forged_size_or_finished_marker_reads_as_absent(store):
    view = JobView(store, TOKEN)
    store.set(STATE_NBYTES_KEY, str(1 << 50))  # a spare would try to fault in a PiB
    store.set(FINISHED_KEY, "0")  # a joiner would leave the job
    assert view.state_nbytes() is None and view.finished() is None
    store.set(STATE_NBYTES_KEY, seal(TOKEN, GENERATION_KEY, "1"))  # a genuine "1", moved
    assert view.state_nbytes() is None
    publish = sealing(store.set, TOKEN)
    publish(STATE_NBYTES_KEY, "4096")
    publish(FINISHED_KEY, "9")
    assert view.state_nbytes() == 4096 and view.finished() == 9
    publish(STATE_NBYTES_KEY, "-1")  # sealed but malformed: refused too
    assert view.state_nbytes() is None and view.refusals.count == 4


def test_the_arrival_barrier_is_not_broken_by_forged_values(store):
    _publish(store, 1)
    store.set(GENERATION_KEY, "5")
    store.set(FINISHED_KEY, "0")
    outcome = []

    def arrive_and_tell():
        try:
            arrive(JobView(store, TOKEN), 1, 2)
            outcome.append("formed")
        except Exception as e:
            outcome.append(type(e).__name__)

    first = threading.Thread(target=arrive_and_tell)
    first.start()
    time.sleep(0.3)
    assert outcome == []  # neither Superseded nor JobFinished: still waiting for its peer
    dist.PrefixStore(arrive_prefix(1), store).add("count", 1)
    first.join(10)
    assert outcome == ["formed"]
    _publish(store, 2, number=False)  # a genuine next plan supersedes, even under a forged number
    with pytest.raises(Superseded):
        arrive(JobView(store, TOKEN), 1, 4)  # the count is 3 of 4


def test_the_watch_hands_on_only_genuine_plans(store):
    seen = []
    watch = Watch(lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10)),
                  None, seen.append, token=TOKEN).start()
    try:
        _publish(store, 1)
        wait_for(lambda: seen == [_plan(1)], 10, "generation 1")
        store.set(plan_key(7), Plan(7, 1, "failed", "forged", {0: "evil"}).to_json())
        for forged in [seal(TOKEN, GENERATION_KEY, "1"), *FORGED, "7"]:  # the last one refused
            store.set(GENERATION_KEY, forged)
            time.sleep(0.05)
        assert seen == [_plan(1)]
        _publish(store, 2, number=False)  # the number stays forged: the plan is found anyway
        wait_for(lambda: seen == [_plan(1), _plan(2)], 10, "generation 2")
    finally:
        watch.stop()


# ---- with the node's channel (hp.core.fanout, issue #14): no store request while waiting ---------------
@pytest.fixture
def channel(store):
    relay = Relay(lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10)),
                  TOKEN, node_rank=0, wait_s=0.3, log=lambda m: None).start()
    mirror = Mirror(relay.channel.path)
    yield relay, mirror
    mirror.close()
    relay.stop(timeout_s=5)


def _worker_store(store):
    """The worker's own client of the job's store, counting what it asks."""
    return counting(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10)))


def test_with_the_channel_a_new_generation_wakes_the_waiters_without_a_store_request(store, channel):
    _, mirror = channel
    own = _worker_store(store)
    view, seen, got = JobView(own, TOKEN, channel=mirror), [], []
    watch = Watch(lambda: pytest.fail("no store client with a channel"), None, seen.append, token=TOKEN,
                  channel=mirror).start()
    try:
        _publish(store, 1)
        assert wait_for_generation(view, 1, timeout_s=10) == _plan(1)
        waiter = threading.Thread(target=lambda: got.append(wait_for_generation(view, 2, timeout_s=10)))
        waiter.start()
        time.sleep(0.3)
        started = time.monotonic()
        _publish(store, 2)
        waiter.join(10)
        assert got == [_plan(2)] and time.monotonic() - started < 1.0
        wait_for(lambda: seen == [_plan(1), _plan(2)], 10, "the watch to hand on both plans")
        assert own.requests == 0
    finally:
        watch.stop()


def test_a_grow_published_just_after_a_failure_does_not_hide_it(store, channel):
    """elastic-kill-during-grow: generation 4 (a rank died while 3 formed) then 5 (a grow, planned) reach
    a watch that wakes once for both: 5 is handed on as unplanned, so the forming of 3 is abandoned."""
    _, mirror = channel
    seen, busy = [], threading.Event()

    def on_superseded(plan):
        seen.append(plan)
        if plan.generation == 3:
            busy.wait(10)  # the watch is held up (a loaded machine) while 4 and 5 are published

    watch = Watch(lambda: None, None, on_superseded, token=TOKEN, channel=mirror).start()
    try:
        for g in (1, 2, 3):
            _publish(store, g)
        wait_for(lambda: seen and seen[-1].generation == 3, 10, "generation 3")
        before = len(seen)
        _publish(store, 4)
        _publish(store, 5, why="grow", at_boundary=True)
        wait_for(lambda: mirror.get(plan_key(5)) is not None, 10, "both forwarded")
        busy.set()
        wait_for(lambda: len(seen) > before, 10, "the watch to wake")
        assert seen[before:] == [_plan(5, why="grow", at_boundary=False)]
        _publish(store, 6, why="grow", at_boundary=True)  # a grow alone stays planned
        wait_for(lambda: len(seen) > before + 1, 10, "generation 6")
        assert seen[before + 1:] == [_plan(6, why="grow", at_boundary=True)]
    finally:
        busy.set()
        watch.stop()


def test_a_forged_value_in_the_channel_is_refused(store, channel):
    relay, mirror = channel
    _publish(store, 1)
    said, seen = [], []
    view = JobView(_worker_store(store), TOKEN, Refusals(lambda key, message: said.append(key)), channel=mirror)
    watch = Watch(lambda: None, None, seen.append, token=TOKEN, channel=mirror).start()
    try:
        assert wait_for_generation(view, 1, timeout_s=10) == _plan(1)
        # what a local process that reached the channel could inject: none of it is acted on
        relay.channel.update({plan_key(2): Plan(2, 1, "failed", "forged", {0: "evil"}).to_json().encode(),
                              plan_key(3): seal(TOKEN, plan_key(1), _plan(1).to_json()).encode(),  # moved
                              spare_key("n0s0"): SpareAssignment(0, 2).to_json().encode()})
        with pytest.raises(TimeoutError):
            wait_for_generation(view, 2, timeout_s=0.3)
        assert view.assignment("n0s0") is None and view.generation() == 1
        assert {plan_key(2), plan_key(3), spare_key("n0s0")} <= set(said)
        time.sleep(0.2)
        assert seen == [_plan(1)]
        _publish(store, 2, state="failed")  # the controller's own, forwarded over the forgery
        assert wait_for_generation(view, 2, timeout_s=10) == _plan(2, state="failed")
        wait_for(lambda: seen == [_plan(1), _plan(2, state="failed")], 10, "the genuine plan")
    finally:
        watch.stop()


def test_with_the_channel_a_spare_waits_for_its_genuine_assignment(store, channel):
    _, mirror = channel
    got = []
    view = JobView(_worker_store(store), TOKEN, channel=mirror)
    waiter = threading.Thread(target=lambda: got.append(wait_for_assignment(view, "n0s0")))
    waiter.start()
    _publish(store, 1)
    store.set(spare_key("n0s0"), SpareAssignment(0, 1).to_json())  # unsealed
    plan = Plan(2, 2, "running", "", {0: "r0.0", 1: "spare.n0s0"})
    sealing(store.set, TOKEN)(plan_key(2), plan.to_json())
    sealing(store.set, TOKEN)(GENERATION_KEY, "2")
    time.sleep(0.3)
    assert got == []
    sealing(store.set, TOKEN)(spare_key("n0s0"), SpareAssignment(1, 2).to_json())
    waiter.join(10)
    assert got == [(1, 2)] and view.store.requests == 0


def test_a_rank_without_the_channel_arriving_last_still_forms_the_barrier(store, channel):
    """A worker whose mirror failed reads the store (hp.core.fanout.Mirror.from_env): when it arrives
    last, its peers that block on the barrier's outcome are woken, not left waiting for a newer generation."""
    _, mirror = channel
    _publish(store, 1)
    done = []
    first = threading.Thread(target=lambda: (arrive(JobView(_worker_store(store), TOKEN, channel=mirror), 1, 2),
                                             done.append("channel")), daemon=True)
    first.start()
    time.sleep(0.3)
    arrive(JobView(_worker_store(store), TOKEN), 1, 2)
    first.join(1.0)  # within a slice of the barrier's wait (2 s): woken, not timed out
    assert done == ["channel"]


def test_with_the_channel_the_arrival_barrier_blocks_and_wakes_at_once(store, channel):
    _, mirror = channel
    _publish(store, 1)
    outcome = []

    def arrive_and_tell(generation: int, world: int) -> None:
        view = JobView(_worker_store(store), TOKEN, channel=mirror)
        try:
            arrive(view, generation, world)
            outcome.append(("formed", view.store.requests))
        except Exception as e:
            outcome.append((type(e).__name__, view.store.requests))

    ranks = [threading.Thread(target=arrive_and_tell, args=(1, 2)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(10)
    assert [o for o, _ in outcome] == ["formed", "formed"]
    assert all(n <= 4 for _, n in outcome)  # add, then wait and get (the last one: compare_set): no polling

    outcome.clear()
    alone = threading.Thread(target=arrive_and_tell, args=(2, 2))  # its peer died: it waits alone
    _publish(store, 2)
    alone.start()
    time.sleep(0.5)
    started = time.monotonic()
    _publish(store, 3)  # the relay ends generation 2's barrier
    alone.join(10)
    assert outcome[0][0] == "Superseded" and time.monotonic() - started < 1.0  # not a slice of 2 s later

    outcome.clear()
    _publish(store, 4)
    sealing(store.set, TOKEN)(FINISHED_KEY, "9")  # the others finished instead of forming generation 4
    late = JobView(_worker_store(store), TOKEN, channel=mirror)
    with pytest.raises(JobFinished):
        arrive(late, 4, 2, slice_s=0.2)


def test_a_worker_whose_agent_died_is_orphaned_before_its_fork_server_dies():
    """A forked worker's parent is the node's fork server, which dies only after the agent: the watch also
    looks at the agent itself (HP_AGENT_PID), dead or a zombie not yet reaped. Before, a failure that came
    first (the store lived in the agent) could find the worker not orphaned yet, and it left without saying
    why (the controller-killed scenario's missing line)."""
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = Watch(lambda: None, None, lambda plan: None, token=TOKEN, agent_pid=agent.pid)
        assert not watch.orphaned()  # our parent (pytest) and the "agent" both alive
        agent.kill()
        wait_for(lambda: open(f"/proc/{agent.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 10, "a zombie")
        assert watch.orphaned()  # dead, not yet reaped
        agent.wait()
        assert watch.orphaned()  # gone
        assert not Watch(lambda: None, None, lambda plan: None, token=TOKEN).orphaned()  # no agent pid: the parent only
    finally:
        agent.kill()
        agent.wait()

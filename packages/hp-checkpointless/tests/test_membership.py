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

from hp.checkpointless.membership import (
    JobView, Superseded, Watch, arrive, wait_for_assignment, wait_for_generation,
)
from hp.core.protocol import (
    FINISHED_KEY, GENERATION_KEY, STATE_NBYTES_KEY, Plan, SpareAssignment, arrive_prefix, plan_key, spare_key,
)
from hp.core.signed_values import Refusals, seal, sealing
from hp.core.testing import wait_for


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

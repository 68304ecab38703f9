"""The elastic controller (hp.core.controller.elastic): shrink, grow, preemption and capacity, driven through
``handle(verb, payload)`` with an injected clock and a publish function that records the store writes.

The scaling decision comes from a small :class:`Scaler` written here (min/max/unit): hp-core's tests never
import hp-elastic.
"""

from __future__ import annotations

import pytest

from hp.core.controller import Controller, ControllerConfig, ElasticController, ElasticPolicy, Refused
from hp.core.protocol import (
    GENERATION_KEY, Decision, FailureAction, JobState, Plan, SpareAssignment, plan_key, spare_key,
)
from hp.core.scaling import CAPACITY, FAILURE, PREEMPTION, Scaler, ScaleEvent, ScaleTarget, renumber


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class UnitScaler:
    """The allowed sizes are the multiples of ``unit`` in [min, max]; the target is the largest allowed
    size <= min(healthy, capacity, max), None below min (as hp-elastic's decide, without its policy)."""

    def __init__(self, min_replicas: int, max_replicas: int, unit: int = 1) -> None:
        self.min_replicas, self.max_replicas, self.unit = min_replicas, max_replicas, unit
        self.asked: list[tuple[int, int, ScaleEvent]] = []

    def target(self, world: int, capacity: int, event: ScaleEvent) -> ScaleTarget:
        self.asked.append((world, capacity, event))
        healthy = world - event.count if event.kind in (FAILURE, PREEMPTION) else capacity
        usable = min(healthy, capacity, self.max_replicas)
        fits = [w for w in range(self.min_replicas, self.max_replicas + 1, self.unit) if w <= usable]
        if not fits:
            return ScaleTarget(None, f"{event.kind}: {usable} usable, below {self.min_replicas}")
        return ScaleTarget(fits[-1], f"{event.kind}: {world} -> {fits[-1]}")


class Store:
    """What the controller published, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    def __call__(self, key: str, value: str) -> None:
        self.writes.append((key, value))

    def plan(self, generation: int) -> Plan:
        return Plan.from_json(dict(self.writes)[plan_key(generation)])

    def assignment(self, spare: str) -> SpareAssignment:
        return SpareAssignment.from_json(dict(self.writes)[spare_key(spare)])

    def keys(self) -> list[str]:
        return [k for k, _ in self.writes]


def elastic(nnodes: int = 2, nproc: int = 2, spares: int = 0, min_replicas: int = 2, max_replicas: int = 4,
            unit: int = 1, **cfg) -> tuple[ElasticController, Store, UnitScaler, Clock]:
    clock, store, scaler = Clock(), Store(), UnitScaler(min_replicas, max_replicas, unit)
    c = ElasticController(ControllerConfig(nnodes=nnodes, **cfg), scaler, clock=clock, publish=store)
    for n in range(nnodes):
        c.handle("join", {"node_rank": n, "nproc": nproc, "host": f"h{n}", "spares": spares})
    assert c.state is JobState.RUNNING and c.generation == 1
    return c, store, scaler, clock


def died(c: ElasticController, node: int, rank: int, holder: str | None = None, **extra) -> dict:
    payload = {"node_rank": node, "generation": c.generation, "rank": rank, "signal": "SIGKILL",
               "holder": c.holders.get(rank, "") if holder is None else holder, **extra}
    return c.handle("worker_failed", payload)


def decisions(c: Controller, name: str) -> list[dict]:
    return [d for d in c.decisions if d["decision"] == name]


def refused(c: Controller, verb: str, payload: dict) -> Refused:
    before = (c.generation, dict(c.members), dict(c.holders))
    with pytest.raises(Refused) as e:
        c.handle(verb, payload)
    assert (c.generation, c.members, c.holders) == before  # a refusal changes nothing
    assert "\n" not in e.value.message
    assert c.decisions[-1]["decision"] == Decision.REFUSED and c.decisions[-1]["request"] == verb
    return e.value


def test_the_test_scaler_is_a_scaler():
    assert isinstance(UnitScaler(1, 2), Scaler)


# ---- 1. shrink --------------------------------------------------------------------------------
def test_a_rank_dying_with_no_spare_shrinks_the_job_and_renumbers_the_survivors_stably():
    c, store, scaler, _ = elastic()
    # in-process failures counted against ranks 1 and 3 (generations 2 and 3)
    c.handle("rank_failed", {"node_rank": 1, "generation": 1, "rank": 3, "holder": c.holders[3], "reason": "exception"})
    c.handle("rank_failed", {"node_rank": 0, "generation": 2, "rank": 1, "holder": c.holders[1], "reason": "exception"})
    assert c.rank_exceptions == {3: 1, 1: 1}

    d = died(c, 0, 1, holder="r1.0", pid=9)
    assert d == {"action": FailureAction.SHRINK, "generation": 4, "world_size": 3}
    assert scaler.asked[-1] == (4, 4, ScaleEvent(FAILURE, 1))
    plan = store.plan(4)
    assert plan.world_size == 3 and plan.state == JobState.RUNNING
    assert plan.holders == {0: "r0.0", 1: "r2.0", 2: "r3.0"}
    assert plan.at_boundary is False and plan.why == "shrink"
    assert store.keys()[-2:] == [plan_key(4), GENERATION_KEY]  # the plan before its number
    assert c.members == {0: 0, 1: 1, 2: 1}
    assert c.rank_exceptions == {2: 1}  # rank 3's count follows it to rank 2; the dead rank's is gone

    [shrink] = decisions(c, Decision.SHRINK)
    assert shrink["old_world"] == 4 and shrink["world_size"] == 3
    assert shrink["leaving"] == [1] and shrink["joining"] == [] and shrink["ranks"] == [1]
    assert shrink["cause"] == "was killed by SIGKILL" and shrink["generation"] == 3
    assert c.decisions[-1]["decision"] == Decision.NEW_GENERATION and c.decisions[-1]["why"] == "shrink"
    assert c.decisions[-1]["world_size"] == 3

    snap = c.snapshot()
    assert snap["world_size"] == 3 and snap["members"] == {0: 0, 1: 1, 2: 1} and snap["generation"] == 4
    assert (snap["capacity"], snap["joiners"], snap["min_replicas"], snap["max_replicas"]) == (None, [], 2, 4)
    assert snap["state"] == "running"

    # the survivors learn their new ranks by holder id
    assert c.handle("heartbeat", {"node_rank": 1, "generation": 4})["ranks"] == {"r2.0": 1, "r3.0": 2}
    assert c.handle("heartbeat", {"node_rank": 0, "generation": 4})["ranks"] == {"r0.0": 0}

    # a second report about the dead process: rank 1 is node 1's now
    e = refused(c, "worker_failed", {"node_rank": 0, "generation": 4, "rank": 1, "holder": "r1.0",
                                     "signal": "SIGKILL"})
    assert e.status == 403


def test_a_second_report_about_a_dead_rank_0_is_refused_as_a_stale_holder():
    c, store, _, _ = elastic()
    assert died(c, 0, 0, holder="r0.0")["action"] == FailureAction.SHRINK
    assert store.plan(2).holders == {0: "r1.0", 1: "r2.0", 2: "r3.0"}
    e = refused(c, "worker_failed", {"node_rank": 0, "generation": 2, "rank": 0, "holder": "r0.0", "exitcode": 1})
    assert e.status == 409 and e.message == "stale holder 'r0.0' of rank 0 (now 'r1.0')"


def test_a_report_by_holder_finds_the_renumbered_rank():
    c, store, _, _ = elastic(min_replicas=1)
    died(c, 0, 0, holder="r0.0")  # r3.0 is rank 2 now
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 3, "holder": "r3.0", "exitcode": 1})
    assert d == {"action": FailureAction.SHRINK, "generation": 3, "world_size": 2}
    assert store.plan(3).holders == {0: "r1.0", 1: "r2.0"}
    assert decisions(c, Decision.SHRINK)[-1]["ranks"] == [2]


def test_a_unit_larger_than_one_makes_the_dead_rank_s_unit_leave_with_it():
    """Units are consecutive ranks (an HSDP shard group): the dead rank's unit-mates leave, and the ranks that
    stay keep their rank modulo the unit (the shard each holds)."""
    c, store, scaler, _ = elastic(min_replicas=2, max_replicas=4, unit=2)
    d = died(c, 0, 1, holder="r1.0")
    assert d == {"action": FailureAction.SHRINK, "generation": 2, "world_size": 2}
    assert scaler.asked[-1][2] == ScaleEvent(FAILURE, 2)  # the unit is what the job loses
    plan = store.plan(2)
    assert plan.holders == {0: "r2.0", 1: "r3.0"} and plan.why == "shrink" and plan.at_boundary is False
    shrink = decisions(c, Decision.SHRINK)[-1]
    assert shrink["leaving"] == [0, 1] and shrink["ranks"] == [1]
    assert c.members == {0: 1, 1: 1}


def test_with_units_a_failure_below_the_target_drops_the_highest_whole_units_too():
    c, store, _, _ = elastic(nnodes=6, nproc=1, min_replicas=2, max_replicas=4, unit=2)
    assert len(c.members) == 6
    d = died(c, 2, 2, holder="r2.0")  # unit 1 goes; 4 left, the maximum
    assert d["world_size"] == 4
    assert store.plan(2).holders == {0: "r0.0", 1: "r1.0", 2: "r4.0", 3: "r5.0"}
    assert decisions(c, Decision.SHRINK)[-1]["leaving"] == [2, 3]


# ---- 2. below the minimum: the fixed-size rungs -------------------------------------------------
def test_below_the_minimum_a_dead_rank_is_restarted_within_the_budget_then_the_job_stops():
    c, store, _, _ = elastic(min_replicas=4, max_restarts=1)
    d = died(c, 0, 1, holder="r1.0")
    assert d == {"action": FailureAction.RESTART, "generation": 2, "rank": 1, "holder": "r1.1"}
    escalate = decisions(c, Decision.ESCALATE)[-1]
    assert escalate["ranks"] == [1] and "below 4" in escalate["reason"]
    plan = store.plan(2)
    assert plan.world_size == 4 and plan.why == "worker_restart" and plan.holders[1] == "r1.1"
    assert decisions(c, Decision.SHRINK) == []

    d = died(c, 1, 2, holder="r2.0", pid=5)
    assert d["action"] == FailureAction.STOP and c.state is JobState.FAILED
    assert "rank 2 (node 1, pid 5) was killed by SIGKILL" in d["reason"]
    assert "restarts exhausted (1/1)" in d["reason"]
    assert store.plan(3).state == JobState.FAILED and store.plan(3).why == "job_failed"
    assert c.snapshot()["state"] == "failed" and c.snapshot()["world_size"] == 4


def test_a_job_shrunk_to_its_minimum_stops_at_the_next_death_without_restarts():
    c, store, _, _ = elastic(min_replicas=3)
    assert died(c, 1, 3, holder="r3.0")["action"] == FailureAction.SHRINK
    d = died(c, 0, 0, holder="r0.0")
    assert d["action"] == FailureAction.STOP and c.state is JobState.FAILED
    assert "restarts exhausted (0/0)" in c.reason
    assert c.snapshot()["world_size"] == 3


# ---- 3. the replacement of a dead rank joins ---------------------------------------------------
def test_the_replacement_of_a_dead_rank_grows_the_job_back_when_ready():
    c, store, scaler, _ = elastic()
    died(c, 0, 1, holder="r1.0")  # generation 2, world 3
    assert c.handle("spare_added", {"node_rank": 0, "generation": c.generation, "spare": "n0s0", "joiner": True}) == {"free_spares": 1}
    assert c.snapshot()["joiners"] == ["n0s0"] and c.generation == 2  # starting: nothing changes yet

    assert c.handle("spare_ready", {"node_rank": 0, "spare": "n0s0"}) == {"ready": True}
    assert c.generation == 3 and scaler.asked[-1] == (3, 4, ScaleEvent(CAPACITY))
    plan = store.plan(3)
    assert plan.world_size == 4 and plan.why == "grow" and plan.at_boundary is True
    assert plan.holders == {0: "r0.0", 1: "r2.0", 2: "r3.0", 3: "spare.n0s0"}
    assert store.assignment("n0s0") == SpareAssignment(3, 3)
    assert store.keys()[-3:] == [plan_key(3), GENERATION_KEY, spare_key("n0s0")]
    assert c.members == {0: 0, 1: 1, 2: 1, 3: 0}

    [grow] = decisions(c, Decision.GROW)
    assert grow["old_world"] == 3 and grow["world_size"] == 4 and grow["joining"] == ["n0s0"]
    assert grow["leaving"] == []
    promoted = decisions(c, Decision.PROMOTE_SPARE)[-1]
    assert (promoted["rank"], promoted["spare"], promoted["ready"], promoted["failed_node"]) == (3, "n0s0", True, None)
    assert promoted["generation"] == 3

    beat = c.handle("heartbeat", {"node_rank": 0, "generation": 2})
    assert beat["generation"] == 3
    assert beat["promotions"] == [{"spare": "n0s0", "rank": 3, "generation": 3}]
    assert beat["ranks"] == {"r0.0": 0, "spare.n0s0": 3}
    assert c.handle("heartbeat", {"node_rank": 0, "generation": 3})["promotions"] == []
    beat = c.handle("heartbeat", {"node_rank": 1, "generation": 3})
    assert beat["promotions"] == [] and beat["ranks"] == {"r2.0": 1, "r3.0": 2}

    snap = c.snapshot()
    assert snap["world_size"] == 4 and snap["joiners"] == [] and snap["free_spares"] == []
    assert snap["ready_spares"] == []


def test_a_replacement_spare_that_is_not_a_joiner_stays_in_reserve():
    c, store, _, _ = elastic()
    died(c, 0, 1, holder="r1.0")
    c.handle("spare_added", {"node_rank": 0, "generation": c.generation, "spare": "n0s0"})  # no joiner flag: a replenished spare
    assert c.handle("spare_ready", {"node_rank": 0, "spare": "n0s0"}) == {"ready": True}
    assert c.generation == 2 and len(c.members) == 3 and sorted(c.free_spares) == ["n0s0"]
    assert c.snapshot()["joiners"] == []


def test_a_joiner_does_not_grow_the_job_past_max_replicas():
    c, store, _, _ = elastic(max_replicas=3)
    died(c, 0, 1, holder="r1.0")
    c.handle("spare_added", {"node_rank": 0, "generation": c.generation, "spare": "n0s0", "joiner": True})
    c.handle("spare_ready", {"node_rank": 0, "spare": "n0s0"})
    # the job started above max (4 > 3); shrunk to max, it never grows past it
    assert c.generation == 2 and len(c.members) == 3
    assert c.snapshot()["joiners"] == ["n0s0"]


# ---- 4. reserve spares -------------------------------------------------------------------------
def test_a_reserve_spare_replaces_a_dead_rank_and_never_grows_the_job():
    c, store, scaler, _ = elastic(spares=1, max_replicas=5)
    for n in (0, 1):
        assert c.handle("spare_ready", {"node_rank": n, "spare": f"n{n}s0"}) == {"ready": True}
    assert c.generation == 1 and len(c.members) == 4  # world 4 < max 5, but a reserve spare is no joiner
    assert scaler.asked == []

    d = died(c, 0, 1, holder="r1.0")
    assert d == {"action": FailureAction.PROMOTE_SPARE, "spare": "n0s0", "rank": 1, "generation": 2}
    plan = store.plan(2)
    assert plan.world_size == 4 and plan.why == "spare_promoted" and plan.at_boundary is False
    assert plan.holders == {0: "r0.0", 1: "spare.n0s0", 2: "r2.0", 3: "r3.0"}
    assert decisions(c, Decision.SHRINK) == [] and scaler.asked == []

    # more capacity does not turn the remaining reserve spare into a rank
    assert c.handle("scale", {"replicas": 5}) == {"generation": 2, "world_size": 4, "capacity": 5}
    assert c.generation == 2 and sorted(c.free_spares) == ["n1s0"] and decisions(c, Decision.GROW) == []


def test_a_reserve_spare_does_not_grow_a_job_scaled_below_its_size():
    c, store, _, _ = elastic(spares=1)
    c.handle("scale", {"replicas": 3})
    c.handle("scale", {"replicas": 4})
    for n in (0, 1):
        c.handle("spare_ready", {"node_rank": n, "spare": f"n{n}s0"})
    assert len(c.members) == 3 and c.generation == 2 and sorted(c.free_spares) == ["n0s0", "n1s0"]


# ---- 5. a late node --------------------------------------------------------------------------
def test_a_late_node_joins_as_spares_and_grows_the_job_up_to_max_replicas():
    c, store, scaler, _ = elastic(max_replicas=5, max_nodes=3)
    assert c.handle("join", {"node_rank": 2, "nproc": 2, "host": "h2", "spares": 1}) == {"joined": True}
    assert c.generation == 1  # nothing changes for the ranks until its processes are ready
    join = c.decisions[-1]
    assert join["decision"] == Decision.JOIN and join["late"] is True and join["node_rank"] == 2
    a = c.handle("rendezvous", {"node_rank": 2})
    assert a["state"] == "running" and a["rank_offset"] == -1 and a["world_size"] == 4 and a["generation"] == 1
    assert a["spare_ids"] == ["n2s0", "n2s1", "n2s2"]
    snap = c.snapshot()
    assert snap["joiners"] == ["n2s0", "n2s1"]  # its nproc processes; the extra one is a reserve spare
    assert snap["free_spares"] == ["n2s0", "n2s1", "n2s2"] and snap["nodes"][2]["done"] is False

    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s0"})
    assert c.generation == 1 and scaler.asked == []  # a node's joiners grow the job together
    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s1"})
    assert c.generation == 2 and scaler.asked[-1] == (4, 6, ScaleEvent(CAPACITY))
    plan = store.plan(2)
    assert plan.world_size == 5 and plan.why == "grow" and plan.at_boundary is True
    assert plan.holders == {0: "r0.0", 1: "r1.0", 2: "r2.0", 3: "r3.0", 4: "spare.n2s0"}  # max 5: n2s1 waits
    assert store.assignment("n2s0") == SpareAssignment(4, 2)
    assert spare_key("n2s1") not in store.keys()

    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s2"})  # a reserve spare never grows the job
    assert c.generation == 2 and len(c.members) == 5
    assert c.snapshot()["joiners"] == ["n2s1"] and sorted(c.free_spares) == ["n2s1", "n2s2"]
    beat = c.handle("heartbeat", {"node_rank": 2, "generation": 2})
    assert beat["promotions"] == [{"spare": "n2s0", "rank": 4, "generation": 2}]
    assert beat["ranks"] == {"spare.n2s0": 4}


def test_several_ready_joiners_grow_the_job_in_one_generation_when_capacity_lets_them():
    c, store, _, _ = elastic(max_replicas=6, max_nodes=3)
    c.handle("scale", {"replicas": 4})  # capacity 4: the joiners wait
    c.handle("join", {"node_rank": 2, "nproc": 2, "host": "h2"})
    for s in ("n2s0", "n2s1"):
        c.handle("spare_ready", {"node_rank": 2, "spare": s})
    assert c.generation == 1
    assert c.handle("scale", {"replicas": 6}) == {"generation": 2, "world_size": 6, "capacity": 6}
    plan = store.plan(2)
    assert plan.why == "grow" and plan.holders[4] == "spare.n2s0" and plan.holders[5] == "spare.n2s1"
    assert [store.assignment(s) for s in ("n2s0", "n2s1")] == [SpareAssignment(4, 2), SpareAssignment(5, 2)]


def test_a_node_s_joiners_grow_the_job_together_in_one_generation():
    c, store, _, _ = elastic(max_replicas=8, max_nodes=4)
    for n in (2, 3):
        c.handle("join", {"node_rank": n, "nproc": 2, "host": f"h{n}"})
    for s in ("n2s0", "n3s1", "n2s1"):  # node 2 complete, node 3 half ready
        c.handle("spare_ready", {"node_rank": int(s[1]), "spare": s})
    assert c.generation == 2 and decisions(c, Decision.GROW)[-1]["joining"] == ["n2s0", "n2s1"]
    assert [store.plan(2).holders[r] for r in (4, 5)] == ["spare.n2s0", "spare.n2s1"]
    assert len(c.members) == 6
    c.handle("spare_ready", {"node_rank": 3, "spare": "n3s0"})
    assert c.generation == 3 and [store.plan(3).holders[r] for r in (6, 7)] == ["spare.n3s0", "spare.n3s1"]


def test_a_dead_rank_s_replacement_does_not_wait_for_another_node_s_joiners():
    c, store, _, _ = elastic(max_replicas=6, max_nodes=3)
    died(c, 0, 1, holder="r1.0")  # shrink: world 3, generation 2
    c.handle("join", {"node_rank": 2, "nproc": 2, "host": "h2"})  # starting
    c.handle("spare_added", {"node_rank": 0, "generation": c.generation, "spare": "n0s0", "joiner": True})
    c.handle("spare_ready", {"node_rank": 0, "spare": "n0s0"})
    assert c.generation == 3 and store.plan(3).holders == {0: "r0.0", 1: "r2.0", 2: "r3.0", 3: "spare.n0s0"}
    assert c.snapshot()["joiners"] == ["n2s0", "n2s1"]


@pytest.mark.parametrize("node_rank, status, message", [
    (3, 400, "node_rank 3 outside [0, 3)"),
    (1, 409, "node_rank 1 is already in the job (from h1)"),
])
def test_a_bad_late_join_is_refused(node_rank, status, message):
    c, _, _, _ = elastic(max_nodes=3)
    e = refused(c, "join", {"node_rank": node_rank, "nproc": 1, "host": "hx"})
    assert (e.status, e.message) == (status, message)
    assert sorted(c.nodes) == [0, 1]


def test_without_max_nodes_no_new_node_rank_may_join():
    c, _, _, _ = elastic()
    assert refused(c, "join", {"node_rank": 2, "nproc": 1, "host": "hx"}).status == 400


def test_a_node_rank_that_left_rejoins_with_spare_ids_never_used_before():
    c, store, _, _ = elastic(max_replicas=6, max_nodes=3)
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    assert c.handle("rendezvous", {"node_rank": 2})["spare_ids"] == ["n2s0"]
    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s0"})  # grows: rank 4 is spare.n2s0
    assert store.plan(2).holders[4] == "spare.n2s0"
    c.handle("spare_added", {"node_rank": 2, "generation": c.generation, "spare": "n2s1"})  # a replenished spare
    c.handle("node_leaving", {"node_rank": 2, "generation": 2})
    assert store.plan(3).holders == {0: "r0.0", 1: "r1.0", 2: "r2.0", 3: "r3.0"}

    c.handle("join", {"node_rank": 2, "nproc": 2, "host": "h2b", "spares": 1})
    a = c.handle("rendezvous", {"node_rank": 2})
    assert a["rank_offset"] == -1 and a["spare_ids"] == ["n2s2", "n2s3", "n2s4"]
    assert c.snapshot()["joiners"] == ["n2s2", "n2s3"] and c.snapshot()["nodes"][2]["done"] is False
    # the agent's own next id follows its last one: never one the controller gave before
    e = refused(c, "spare_added", {"node_rank": 2, "generation": c.generation, "spare": "n2s1"})
    assert e.status == 409
    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s3"})
    assert c.generation == 3  # n2s2 still starting
    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s2"})
    plan = store.plan(4)
    assert plan.holders == {0: "r0.0", 1: "r1.0", 2: "r2.0", 3: "r3.0", 4: "spare.n2s2", 5: "spare.n2s3"}
    assert [store.assignment(s) for s in ("n2s2", "n2s3")] == [SpareAssignment(4, 4), SpareAssignment(5, 4)]
    assert c.handle("heartbeat", {"node_rank": 2, "generation": 4})["ranks"] == {"spare.n2s2": 4, "spare.n2s3": 5}


def test_a_spares_only_node_leaving_then_rejoining_gets_new_ids():
    c, _, _, _ = elastic(max_nodes=3)
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    assert c.handle("node_leaving", {"node_rank": 2, "generation": 1})["action"] == FailureAction.LEAVE
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    assert c.handle("rendezvous", {"node_rank": 2})["spare_ids"] == ["n2s1"]


# ---- 6. preemption ---------------------------------------------------------------------------
def test_a_preempted_node_s_ranks_leave_at_a_step_boundary():
    c, store, scaler, _ = elastic(spares=1)
    c.handle("spare_ready", {"node_rank": 1, "spare": "n1s0"})
    d = c.handle("node_leaving", {"node_rank": 1, "generation": 1, "signal": "SIGTERM"})
    # its agent stops the spares named; one promoted since its last heartbeat leaves like a rank
    assert d == {"action": FailureAction.LEAVE, "generation": 2, "world_size": 2, "spares": ["n1s0"]}
    assert scaler.asked[-1] == (4, 2, ScaleEvent(PREEMPTION, 2))
    plan = store.plan(2)
    assert plan.world_size == 2 and plan.why == "preempt" and plan.at_boundary is True
    assert plan.holders == {0: "r0.0", 1: "r1.0"}
    assert sorted(c.free_spares) == ["n0s0"] and c.snapshot()["ready_spares"] == []  # its spares go with it
    preempt = decisions(c, Decision.PREEMPT)[-1]
    assert preempt["leaving"] == [2, 3] and preempt["node_rank"] == 1 and preempt["world_size"] == 2
    snap = c.snapshot()
    assert snap["nodes"][1]["done"] is True and snap["nodes"][1]["lost"] is False and snap["world_size"] == 2


def test_preempting_the_first_node_renumbers_the_others_from_zero():
    c, store, _, _ = elastic()
    c.handle("node_leaving", {"node_rank": 0, "generation": 1})
    assert store.plan(2).holders == {0: "r2.0", 1: "r3.0"}
    assert c.handle("heartbeat", {"node_rank": 1, "generation": 2})["ranks"] == {"r2.0": 0, "r3.0": 1}
    assert c.handle("heartbeat", {"node_rank": 0, "generation": 2})["ranks"] == {}


def test_a_preemption_below_the_minimum_preempts_the_whole_job_which_saves_and_stops():
    c, store, _, _ = elastic(spares=1, min_replicas=3)
    members, holders = dict(c.members), dict(c.holders)
    d = c.handle("node_leaving", {"node_rank": 1, "generation": 1})
    assert d["action"] == FailureAction.SAVE and d["generation"] == 2 and "below 3" in d["reason"]
    assert c.state is JobState.PREEMPTED and (c.members, c.holders) == (members, holders)
    plan = store.plan(2)  # every rank keeps its place: they form once more, to save together
    assert plan.state == JobState.PREEMPTED and plan.holders == holders and plan.at_boundary is False
    assert plan.why == "preempted" and store.keys()[-1] == GENERATION_KEY
    assert decisions(c, Decision.PREEMPT_JOB)[-1]["reason"] == d["reason"] and decisions(c, Decision.PREEMPT) == []


def test_the_node_hosting_the_controller_preempts_the_job_and_every_later_leaver_is_told_to_save():
    c, store, _, _ = elastic()
    d = c.handle("node_leaving", {"node_rank": 0, "generation": 1, "hosts_controller": True})
    assert d == {"action": FailureAction.SAVE, "generation": 2, "reason": "node 0, which hosts the controller, is preempted"}
    writes = len(store.writes)
    assert c.handle("node_leaving", {"node_rank": 1, "generation": 2}) == d  # idempotent: no new generation
    assert len(store.writes) == writes and len(decisions(c, Decision.PREEMPT_JOB)) == 1


def test_a_preempted_job_is_finished_once_every_node_reported_its_ranks_done():
    c, _, _, _ = elastic()
    assert "finished" not in c.handle("heartbeat", {"node_rank": 0, "generation": 1})  # only once preempted
    c.handle("node_leaving", {"node_rank": 0, "generation": 1, "hosts_controller": True})
    c.handle("node_done", {"node_rank": 0, "generation": 2})
    assert c.handle("heartbeat", {"node_rank": 0, "generation": 2})["finished"] is False
    c.handle("node_done", {"node_rank": 1, "generation": 2})
    beat = c.handle("heartbeat", {"node_rank": 0, "generation": 2})
    assert beat["finished"] is True and beat["state"] == JobState.PREEMPTED  # never "succeeded"
    with pytest.raises(Refused) as e:  # nothing moves a preempted job any more
        c.handle("scale", {"node_rank": 0, "generation": 2, "replicas": 2})
    assert e.value.status == 409


def test_a_node_holding_only_spares_leaves_without_a_new_generation():
    c, store, _, _ = elastic(max_nodes=3)
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2", "spares": 1})
    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s1"})
    writes = len(store.writes)
    d = c.handle("node_leaving", {"node_rank": 2, "generation": 1})
    assert d == {"action": FailureAction.LEAVE, "generation": 1, "world_size": 4, "spares": ["n2s0", "n2s1"]}
    assert len(store.writes) == writes and decisions(c, Decision.PREEMPT) == []
    snap = c.snapshot()
    assert snap["joiners"] == [] and snap["free_spares"] == [] and snap["nodes"][2]["done"] is True


def test_a_preemption_with_a_unit_larger_than_one_drops_the_leaving_rank_s_unit():
    c, store, _, _ = elastic(nnodes=4, nproc=1, min_replicas=2, max_replicas=4, unit=2)
    d = c.handle("node_leaving", {"node_rank": 1, "generation": 1})
    assert d == {"action": FailureAction.LEAVE, "generation": 2, "world_size": 2, "spares": []}
    assert store.plan(2).holders == {0: "r2.0", 1: "r3.0"}
    assert decisions(c, Decision.PREEMPT)[-1]["leaving"] == [0, 1]


def test_node_leaving_from_a_stranger_or_before_the_rendezvous_is_refused():
    c, _, _, _ = elastic()
    assert refused(c, "node_leaving", {"node_rank": 5, "generation": 1}).status == 403
    fresh = ElasticController(ControllerConfig(nnodes=2), UnitScaler(1, 2))
    fresh.handle("join", {"node_rank": 0, "nproc": 1, "host": "h"})
    e = refused(fresh, "node_leaving", {"node_rank": 0, "generation": 0})
    assert e.status == 409 and e.message == "job is rendezvous"


# ---- 7. capacity: hp scale -----------------------------------------------------------------------
def test_scaling_in_makes_the_highest_ranks_leave_at_a_step_boundary():
    c, store, scaler, _ = elastic()
    assert c.handle("scale", {"replicas": 3}) == {"generation": 2, "world_size": 3, "capacity": 3}
    assert scaler.asked[-1] == (4, 3, ScaleEvent(CAPACITY))
    plan = store.plan(2)
    assert plan.world_size == 3 and plan.why == "scale" and plan.at_boundary is True
    assert plan.holders == {0: "r0.0", 1: "r1.0", 2: "r2.0"}
    capacity = decisions(c, Decision.CAPACITY)[-1]
    assert capacity["replicas"] == 3 and capacity["world_size"] == 4
    assert decisions(c, Decision.PREEMPT)[-1]["leaving"] == [3]
    assert c.snapshot()["capacity"] == 3

    assert c.handle("scale", {"replicas": 2}) == {"generation": 3, "world_size": 2, "capacity": 2}
    assert store.plan(3).holders == {0: "r0.0", 1: "r1.0"}
    assert c.handle("heartbeat", {"node_rank": 1, "generation": 3})["ranks"] == {}


def test_scaling_out_grows_into_ready_joiners_only():
    c, store, _, _ = elastic(max_nodes=3, max_replicas=6)
    c.handle("scale", {"replicas": 3})  # generation 2: rank 3 leaves
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s0"})
    assert c.generation == 2 and len(c.members) == 3  # the capacity holds it back

    assert c.handle("scale", {"replicas": 6}) == {"generation": 3, "world_size": 4, "capacity": 6}
    plan = store.plan(3)
    assert plan.why == "grow" and plan.at_boundary is True
    assert plan.holders == {0: "r0.0", 1: "r1.0", 2: "r2.0", 3: "spare.n2s0"}
    assert store.assignment("n2s0") == SpareAssignment(3, 3)
    # nothing more to grow into: the capacity is recorded, the world stays
    assert c.handle("scale", {"replicas": 5}) == {"generation": 3, "world_size": 4, "capacity": 5}


def test_scaling_to_the_current_size_changes_no_generation():
    c, store, _, _ = elastic()
    writes = len(store.writes)
    assert c.handle("scale", {"replicas": 4}) == {"generation": 1, "world_size": 4, "capacity": 4}
    assert len(store.writes) == writes


@pytest.mark.parametrize("replicas", [1, 0])
def test_scaling_below_the_minimum_is_refused(replicas):
    c, _, _, _ = elastic(min_replicas=2)
    c.handle("scale", {"replicas": 3})
    e = refused(c, "scale", {"replicas": replicas})
    assert e.status == 409 and e.message.startswith(f"cannot scale to {replicas}: ")
    assert c.capacity == 3


@pytest.mark.parametrize("payload, message", [
    ({"replicas": -1}, "replicas must be >= 0, got -1"),
    ({"replicas": "3"}, "malformed request: field 'replicas' must be int"),
    ({"replicas": True}, "malformed request: field 'replicas' must be int"),
    ({"replicas": 2.5}, "malformed request: field 'replicas' must be int"),
    ({}, "malformed request: field 'replicas' must be int"),
])
def test_bad_scale_values_are_refused(payload, message):
    c, _, scaler, _ = elastic()
    e = refused(c, "scale", payload)
    assert (e.status, e.message) == (400, message)
    assert c.capacity is None and scaler.asked == []


def test_scale_before_the_rendezvous_is_refused():
    c = ElasticController(ControllerConfig(nnodes=2), UnitScaler(1, 2))
    e = refused(c, "scale", {"replicas": 1})
    assert e.status == 409 and e.extra["state"] == "rendezvous"


# ---- 8. success ------------------------------------------------------------------------------
def test_the_job_succeeds_when_every_node_holding_a_rank_is_done_whatever_spares_only_nodes_do():
    c, _, _, _ = elastic(max_nodes=3)
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    c.handle("node_done", {"node_rank": 0, "generation": 1})
    assert c.state is JobState.RUNNING
    c.handle("node_done", {"node_rank": 1, "generation": 1})
    assert c.state is JobState.SUCCEEDED and c.snapshot()["nodes"][2]["done"] is False
    assert decisions(c, Decision.JOB_SUCCEEDED)


def test_no_grow_after_a_member_node_reported_done():
    c, store, _, _ = elastic(max_nodes=3, max_replicas=5)
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    c.handle("node_done", {"node_rank": 0, "generation": 1})
    assert c.handle("spare_ready", {"node_rank": 2, "spare": "n2s0"}) == {"ready": True}
    assert c.generation == 1 and len(c.members) == 4 and decisions(c, Decision.GROW) == []
    assert c.handle("scale", {"replicas": 5})["world_size"] == 4 and c.generation == 1
    c.handle("node_done", {"node_rank": 1, "generation": 1})
    assert c.state is JobState.SUCCEEDED


def test_a_preempted_node_is_not_waited_for():
    c, _, _, _ = elastic()
    c.handle("node_leaving", {"node_rank": 1, "generation": 1})
    c.handle("node_done", {"node_rank": 0, "generation": 2})
    assert c.state is JobState.SUCCEEDED


# ---- 9. a fixed-size job -----------------------------------------------------------------------
@pytest.mark.parametrize("verb, payload", [
    ("scale", {"replicas": 2}),
    ("node_leaving", {"node_rank": 0, "generation": 1}),
])
def test_a_fixed_size_job_refuses_to_scale(verb, payload):
    c = Controller(ControllerConfig(nnodes=1))
    c.handle("join", {"node_rank": 0, "nproc": 2, "host": "h"})
    e = refused(c, verb, payload)
    assert e.status == 409 and e.message.startswith("this job has a fixed size")
    assert "--nnodes MIN:MAX --scaling-policy FILE" in e.message


# ---- 10. renumber ----------------------------------------------------------------------------
@pytest.mark.parametrize("holders, members, leaving, joining, expected", [
    # nothing changes
    ({0: "a", 1: "b"}, {0: 0, 1: 0}, set(), [], ({0: "a", 1: "b"}, {0: 0, 1: 0}, {0: 0, 1: 1})),
    # a rank in the middle leaves: the higher ones move down, in order
    ({0: "a", 1: "b", 2: "c", 3: "d"}, {0: 0, 1: 0, 2: 1, 3: 1}, {1}, [],
     ({0: "a", 1: "c", 2: "d"}, {0: 0, 1: 1, 2: 1}, {0: 0, 2: 1, 3: 2})),
    # rank 0 leaves
    ({0: "a", 1: "b", 2: "c"}, {0: 0, 1: 1, 2: 2}, {0}, [],
     ({0: "b", 1: "c"}, {0: 1, 1: 2}, {1: 0, 2: 1})),
    # joiners follow the staying ranks, in the order given
    ({0: "a", 1: "b"}, {0: 0, 1: 0}, set(), [("y", 3), ("x", 2)],
     ({0: "a", 1: "b", 2: "y", 3: "x"}, {0: 0, 1: 0, 2: 3, 3: 2}, {0: 0, 1: 1})),
    # leave and join at once
    ({0: "a", 1: "b", 2: "c"}, {0: 0, 1: 0, 2: 1}, {0, 2}, [("s", 5)],
     ({0: "b", 1: "s"}, {0: 0, 1: 5}, {1: 0})),
    # everyone leaves
    ({0: "a"}, {0: 0}, {0}, [], ({}, {}, {})),
    # unsorted input keys: the order is by rank, not by insertion
    ({2: "c", 0: "a", 1: "b"}, {2: 1, 0: 0, 1: 0}, {1}, [],
     ({0: "a", 1: "c"}, {0: 0, 1: 1}, {0: 0, 2: 1})),
])
def test_renumber(holders, members, leaving, joining, expected):
    before = (dict(holders), dict(members))
    assert renumber(holders, members, leaving, joining) == expected
    assert (holders, members) == before  # pure: the inputs are not changed


def test_renumber_keeps_holders_and_members_aligned_and_dense():
    holders = {r: f"h{r}" for r in range(8)}
    members = {r: r // 2 for r in range(8)}
    new_holders, new_members, moved = renumber(holders, members, {1, 4, 6}, [("j0", 9), ("j1", 9)])
    assert list(new_holders) == list(range(7)) == list(new_members)
    assert all(new_holders[moved[r]] == holders[r] and new_members[moved[r]] == members[r] for r in moved)
    assert [new_holders[r] for r in range(5)] == ["h0", "h2", "h3", "h5", "h7"]


# ---- cases review found wrong at first (each was a strict xfail until fixed) ------------------------
def test_a_lost_node_without_spares_shrinks_an_elastic_job():
    c, store, _, clock = elastic(heartbeat_timeout_s=5)
    clock.now += 4
    c.handle("heartbeat", {"node_rank": 0, "generation": 1})
    clock.now += 2  # node 1 silent for 6 s
    c.check_liveness()
    assert c.state is JobState.RUNNING, c.reason
    assert c.holders == {0: "r0.0", 1: "r1.0"}


def test_losing_a_node_that_holds_only_spares_does_not_interrupt_the_ranks():
    c, store, _, clock = elastic(max_nodes=3, heartbeat_timeout_s=5)
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    clock.now += 4
    for n in (0, 1):
        c.handle("heartbeat", {"node_rank": n, "generation": 1})
    clock.now += 2  # node 2 silent for 6 s
    c.check_liveness()
    assert c.nodes[2].lost and c.state is JobState.RUNNING
    assert c.generation == 1


def test_after_a_joiner_took_a_dead_rank_the_job_can_still_scale():
    c, store, _, _ = elastic(max_nodes=3)
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    c.handle("spare_ready", {"node_rank": 2, "spare": "n2s0"})  # at max 4: waits as a joiner
    d = died(c, 0, 1, holder="r1.0")  # the ready joiner is the best free spare
    assert d == {"action": FailureAction.MOVED, "rank": 1, "node": 2, "generation": 2}
    assert c.handle("scale", {"replicas": 4}) == {"generation": 2, "world_size": 4, "capacity": 4}
    assert c.snapshot()["joiners"] == []


def test_after_a_joiner_died_the_other_nodes_joiners_still_grow_the_job():
    c, store, _, _ = elastic(max_nodes=4, max_replicas=6)
    for n in (2, 3):
        c.handle("join", {"node_rank": n, "nproc": 1, "host": f"h{n}"})
    c.handle("spare_failed", {"node_rank": 2, "generation": c.generation, "spare": "n2s0"})
    assert c.handle("spare_ready", {"node_rank": 3, "spare": "n3s0"}) == {"ready": True}
    assert store.plan(2).holders[4] == "spare.n3s0"
    assert c.snapshot()["joiners"] == []


def test_after_a_spares_only_node_was_lost_the_job_can_still_scale():
    c, store, _, clock = elastic(max_nodes=3, heartbeat_timeout_s=5)
    c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"})
    clock.now += 4
    for n in (0, 1):
        c.handle("heartbeat", {"node_rank": n, "generation": 1})
    clock.now += 2
    c.check_liveness()
    assert c.nodes[2].lost and c.state is JobState.RUNNING
    assert c.handle("scale", {"replicas": 4})["world_size"] == 4
    assert c.snapshot()["joiners"] == []


def test_ready_joiners_take_the_room_a_preempted_node_leaves():
    c, store, _, _ = elastic(max_nodes=3)
    c.handle("join", {"node_rank": 2, "nproc": 2, "host": "h2"})
    for s in ("n2s0", "n2s1"):
        c.handle("spare_ready", {"node_rank": 2, "spare": s})
    assert len(c.members) == 4  # at max: they wait
    assert c.handle("node_leaving", {"node_rank": 1, "generation": 1})["action"] == FailureAction.LEAVE
    assert len(c.members) == 4
    assert sorted(c.holders.values()) == ["r0.0", "r1.0", "spare.n2s0", "spare.n2s1"]


def test_holder_ids_stay_unique_across_restarts_and_renumbering():
    c, store, _, _ = elastic(min_replicas=3, max_restarts=2)
    assert died(c, 1, 3, holder="r3.0")["action"] == FailureAction.SHRINK  # world 3 = min
    assert died(c, 0, 1, holder="r1.0")["action"] == FailureAction.RESTART  # holder r1.1
    c.handle("spare_added", {"node_rank": 1, "generation": c.generation, "spare": "n1s0", "joiner": True})
    c.handle("spare_ready", {"node_rank": 1, "spare": "n1s0"})  # grows back to 4
    assert c.holders == {0: "r0.0", 1: "r1.1", 2: "r2.0", 3: "spare.n1s0"}
    assert died(c, 0, 0, holder="r0.0")["action"] == FailureAction.SHRINK  # r1.1 is rank 0 now
    assert c.holders == {0: "r1.1", 1: "r2.0", 2: "spare.n1s0"}
    d = died(c, 1, 1, holder="r2.0")  # world 3 = min: restarted
    assert d["action"] == FailureAction.RESTART
    assert len(set(c.holders.values())) == len(c.holders), c.holders
    assert store.plan(c.generation).rank_of("r1.1") == 0


def test_a_repeated_late_join_is_idempotent():
    c, _, _, _ = elastic(max_nodes=3)
    join = {"node_rank": 2, "nproc": 1, "host": "h2"}
    c.handle("join", join)
    assert c.handle("join", join) == {"joined": True}
    assert c.handle("rendezvous", {"node_rank": 2})["spare_ids"] == ["n2s0"]


def test_a_joiner_that_dies_before_its_agent_hears_of_its_rank_is_a_dead_rank():
    """Found by the kill-during-grow chaos scenario: the agent still lists the process as a spare (the
    promotion reaches it with its next heartbeat) and reports spare_failed; the job must not wait for it."""
    c, store, _, _ = elastic(min_replicas=2)
    died(c, 1, 3, holder="r3.0")  # shrink to 3
    c.handle("spare_added", {"node_rank": 1, "generation": c.generation, "spare": "n1s0", "joiner": True})
    c.handle("spare_ready", {"node_rank": 1, "spare": "n1s0"})  # grow: n1s0 holds rank 3
    assert store.plan(c.generation).holders[3] == "spare.n1s0"
    d = c.handle("spare_failed", {"node_rank": 1, "generation": c.generation, "spare": "n1s0"})
    assert d == {"rank": 3, "action": FailureAction.SHRINK, "generation": c.generation, "world_size": 3}
    assert "spare.n1s0" not in store.plan(c.generation).holders.values()


def test_a_free_spare_that_dies_is_only_struck_off():
    c, store, _, _ = elastic(spares=1)
    generation = c.generation
    assert c.handle("spare_failed", {"node_rank": 1, "generation": c.generation, "spare": "n1s0"}) == {"free_spares": 1}
    assert c.generation == generation and decisions(c, Decision.SPARE_LOST)[-1]["spare"] == "n1s0"


# ---- 11. the elastic job is a controller given the elastic policy ----------------------------------
def test_a_controller_given_the_elastic_policy_decides_as_the_elastic_controller():
    def run(make):
        clock, store, scaler = Clock(), Store(), UnitScaler(2, 4)
        c = make(ControllerConfig(nnodes=2, max_nodes=3), scaler, clock, store)
        for n in range(2):
            c.handle("join", {"node_rank": n, "nproc": 2, "host": f"h{n}"})
        answers = [died(c, 1, 3), c.handle("join", {"node_rank": 2, "nproc": 1, "host": "h2"}),
                   c.handle("spare_ready", {"node_rank": 2, "spare": "n2s0"}),
                   c.handle("node_leaving", {"node_rank": 0, "generation": c.generation}),
                   c.handle("scale", {"replicas": 2}), c.snapshot()]
        return answers, [{k: v for k, v in d.items() if k != "t"} for d in c.decisions], store.writes

    composed = run(lambda cfg, s, clock, store: Controller(cfg, clock=clock, publish=store, policy=ElasticPolicy(s)))
    subclass = run(lambda cfg, s, clock, store: ElasticController(cfg, s, clock=clock, publish=store))
    assert composed == subclass
    assert [d["decision"] for d in composed[1]].count(Decision.SHRINK) == 1
    assert composed[0][-1]["capacity"] == 2 and composed[0][-1]["min_replicas"] == 2

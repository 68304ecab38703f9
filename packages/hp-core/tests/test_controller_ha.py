"""The controller's durability, driven without processes: what an HA replica persists, when, and how a
new leader takes over (hp.core.controller.state, Controller.take_over; the etcd side is test_leader)."""

from __future__ import annotations

import json

import pytest

from hp.core.controller import Controller, ControllerConfig, ElasticController, ElasticPolicy, Refused
from hp.core.controller.state import StateError, dump, load
from hp.core.protocol import GENERATION_KEY, JobState, plan_key, spare_key
from hp.core.scaling import ScaleEvent, ScaleTarget


class UnitScaler:
    """Any size in [min, max] (the durability tests need a scaler, not its policy)."""

    def __init__(self, min_replicas: int, max_replicas: int) -> None:
        self.min_replicas, self.max_replicas, self.unit = min_replicas, max_replicas, 1

    def target(self, world: int, capacity: int, event: ScaleEvent) -> ScaleTarget:
        return ScaleTarget(max(self.min_replicas, min(capacity, self.max_replicas)), "test")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Journal:
    """persist and publish, in the order they happened."""

    def __init__(self, fail: bool = False) -> None:
        self.events: list[tuple] = []
        self.states: list[dict] = []
        self.fail = fail

    def persist(self, state: dict, decisions: list[dict]) -> None:
        if self.fail:
            raise RuntimeError("lease lost")
        json.dumps(state)  # JSON all the way down
        self.states.append(state)
        self.events.append(("persist", state["generation"], [d["decision"] for d in decisions]))

    def publish(self, key: str, value: str) -> None:
        self.events.append(("publish", key, value))


def ha_controller(journal: Journal, clock: Clock | None = None, nnodes: int = 2, spares: int = 1) -> Controller:
    c = Controller(ControllerConfig(nnodes=nnodes, max_restarts=1), clock=clock or Clock(), publish=journal.publish,
                   persist=journal.persist)
    c.take_over(None, epoch=1, node_rank=0)
    for n in range(nnodes):
        c.handle("join", {"node_rank": n, "nproc": 2, "host": f"h{n}", "spares": spares})
    return c


def test_a_decision_is_persisted_before_anything_is_published():
    j = Journal()
    ha_controller(j)
    kinds = [e[0] for e in j.events]
    # the election (its write fences the previous leader out); the first join is not persisted (joins are
    # idempotent, agents join a new leader again); the second completes the rendezvous: persist, then publish
    assert kinds == ["persist", "persist", "publish", "publish"]
    assert j.events[1][1] == 1 and j.events[1][2] == ["join", "join", "new_generation"]
    assert [e[1] for e in j.events[2:]] == [plan_key(1), GENERATION_KEY]
    assert j.states[-1]["outbox"][-1] == [GENERATION_KEY, "1"]  # what a new leader would publish again


def test_heartbeats_and_refusals_persist_nothing():
    j = Journal()
    c = ha_controller(j)
    before = len(j.states)
    c.handle("heartbeat", {"node_rank": 0, "generation": 1})
    with pytest.raises(Refused):
        c.handle("worker_failed", {"node_rank": 0, "generation": 0, "rank": 0, "holder": "r0.0"})
    assert len(j.states) == before


def test_a_controller_that_cannot_persist_is_deposed_and_answers_nothing():
    j = Journal()
    c = ha_controller(j)
    j.fail = True
    published = len([e for e in j.events if e[0] == "publish"])
    with pytest.raises(Refused) as e:
        c.handle("worker_failed", {"node_rank": 0, "generation": 1, "rank": 0, "holder": c.holders[0], "signal": "SIGKILL"})
    assert e.value.status == 503 and "deposed (lease lost)" in e.value.message
    assert len([e for e in j.events if e[0] == "publish"]) == published  # the promotion never reached the store
    j.fail = False
    with pytest.raises(Refused) as e:  # and it stays deposed: the new leader decides from now on
        c.handle("heartbeat", {"node_rank": 0, "generation": 1})
    assert e.value.status == 503


def promoted(j: Journal) -> tuple[Controller, dict, dict]:
    c = ha_controller(j)
    request = {"node_rank": 0, "generation": 1, "rank": 1, "holder": c.holders[1], "signal": "SIGKILL", "rid": "abc"}
    answer = c.handle("worker_failed", request)
    assert answer["action"] == "promote_spare" and answer["spare"] == "n0s0"
    return c, request, answer


def test_a_new_leader_takes_over_the_state_and_publishes_the_last_decision_again():
    j = Journal()
    old, _, _ = promoted(j)
    state = j.states[-1]
    k = Journal()
    clock = Clock()
    clock.now = 5000.0  # another process: another monotonic clock
    new = Controller(ControllerConfig(nnodes=2, max_restarts=1), clock=clock, publish=k.publish, persist=k.persist)
    new.take_over(state, epoch=7, node_rank=1)
    assert new.snapshot() == {**old.snapshot(), "decisions": old.decision_count + 1}  # + its election
    assert (new.members, new.holders, new.spares) == (old.members, old.holders, old.spares)
    assert all(n.last_seen == 5000.0 for n in new.nodes.values())  # every node's timeout starts afresh
    republished = [e[1] for e in k.events if e[0] == "publish"]
    assert republished == [plan_key(2), GENERATION_KEY, spare_key("n0s0")]  # in the order the old one made them
    assert k.events[0][0] == "persist" and k.events[0][2] == ["controller_elected"]
    # it goes on deciding where the old one stopped
    d = new.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 2, "holder": new.holders[2],
                                     "signal": "SIGKILL"})
    assert d["generation"] == 3


def test_a_request_retried_at_the_new_leader_gets_the_decision_the_old_one_made():
    j = Journal()
    _, request, answer = promoted(j)
    new = Controller(ControllerConfig(nnodes=2, max_restarts=1), clock=Clock(), publish=lambda k, v: None,
                     persist=lambda s, d: None)
    new.take_over(j.states[-1], epoch=9, node_rank=1)
    assert new.handle("worker_failed", request) == answer  # not "stale holder": the same decision
    assert new.generation == 2  # and not decided twice
    with pytest.raises(Refused) as e:  # the same report without its rid is a stale holder's
        new.handle("worker_failed", {k: v for k, v in request.items() if k != "rid"})
    assert e.value.status == 409


def test_an_unknown_or_foreign_state_is_refused_in_one_line():
    j = Journal()
    c, _, _ = promoted(j)
    fresh = Controller(ControllerConfig(nnodes=2))
    with pytest.raises(StateError, match="version"):
        load(fresh, {**j.states[-1], "version": 99}, 0.0)
    with pytest.raises(StateError, match="malformed controller state"):
        load(fresh, {k: v for k, v in j.states[-1].items() if k != "holders"}, 0.0)
    elastic = ElasticController(ControllerConfig(nnodes=2, max_nodes=3), UnitScaler(min_replicas=1, max_replicas=8))
    with pytest.raises(StateError, match="is a Controller"):
        load(elastic, j.states[-1], 0.0)


def test_the_elastic_controllers_own_state_round_trips():
    j = Journal()
    scaler = UnitScaler(min_replicas=1, max_replicas=8)
    c = ElasticController(ControllerConfig(nnodes=1, max_nodes=2), scaler, clock=Clock(), publish=j.publish,
                          persist=j.persist)
    c.handle("join", {"node_rank": 0, "nproc": 2, "host": "h0", "spares": 1})
    c.handle("scale", {"replicas": 1})
    new = ElasticController(ControllerConfig(nnodes=1, max_nodes=2), scaler, clock=Clock())
    load(new, dump(c, []), 0.0)
    assert (new.capacity, new.joiners, new.members, new.generation) == (c.capacity, c.joiners, c.members, c.generation)
    assert new.state is JobState.RUNNING


def test_each_generation_forms_on_a_live_node_agents_store_never_a_ranks():
    from hp.core.protocol import Plan

    published: list[tuple[str, str]] = []
    clock = Clock()
    c = Controller(ControllerConfig(nnodes=2, heartbeat_timeout_s=5), clock=clock,
                   publish=lambda k, v: published.append((k, v)))
    for n in range(2):
        c.handle("join", {"node_rank": n, "nproc": 1, "host": f"h{n}", "spares": 1,
                          "forming_store": f"10.0.0.{n + 1}:400{n}"})
    plan = lambda g: Plan.from_json(dict(published)[plan_key(g)])  # noqa: E731
    assert plan(1).forming_store == "10.0.0.1:4000"
    clock.now += 10
    c.handle("heartbeat", {"node_rank": 1, "generation": 1})
    c.check_liveness()  # node 0 is lost: its rank goes to node 1's spare, and the group forms on node 1's store
    assert c.nodes[0].lost and plan(2).forming_store == "10.0.0.2:4001"
    with pytest.raises(Refused) as e:
        c.handle("join", {"node_rank": 0, "nproc": 1, "host": "x", "forming_store": "not an address"})
    assert e.value.status in (400, 409)


def test_a_malformed_forming_store_is_refused_at_join():
    c = Controller(ControllerConfig(nnodes=2))
    for bad in ("nohostport", "h:99999", "h/x:1", 5):
        with pytest.raises(Refused) as e:
            c.handle("join", {"node_rank": 0, "nproc": 1, "host": "h", "forming_store": bad})
        assert e.value.status == 400 and "forming_store" in e.value.message
    assert c.nodes == {}


def test_a_finishing_job_is_still_finishing_under_the_next_leader():
    j = Journal()
    c = Controller(ControllerConfig(nnodes=1), clock=Clock(), publish=j.publish, persist=j.persist)
    c.handle("join", {"node_rank": 0, "nproc": 2, "host": "h0", "spares": 0})
    c.handle("finish", {})
    new = Controller(ControllerConfig(nnodes=1), clock=Clock())
    load(new, j.states[-1], 0.0)
    assert new.finishing is True and new.generation == c.generation


def test_the_durable_state_names_the_controller_by_its_policy():
    """The state's ``kind`` is the policy's: a controller given the elastic policy is an elastic controller to
    a replica that takes over, and the other kind is refused."""
    j = Journal()
    scaler = UnitScaler(min_replicas=1, max_replicas=8)
    c = Controller(ControllerConfig(nnodes=1, max_nodes=2), clock=Clock(), publish=j.publish, persist=j.persist,
                   policy=ElasticPolicy(scaler))
    c.handle("join", {"node_rank": 0, "nproc": 2, "host": "h0", "spares": 1})
    c.handle("scale", {"replicas": 1})
    assert j.states[-1]["kind"] == "ElasticController" and j.states[-1]["elastic"]["capacity"] == 1
    new = ElasticController(ControllerConfig(nnodes=1, max_nodes=2), scaler, clock=Clock())
    new.take_over(j.states[-1], epoch=2)
    assert (new.capacity, new.members, new.generation) == (1, c.members, c.generation)
    with pytest.raises(StateError, match="is a ElasticController, this replica runs a Controller"):
        load(Controller(ControllerConfig(nnodes=1)), j.states[-1], 0.0)

"""Controller decisions: rendezvous, generations, fencing, restart budget, liveness."""

from __future__ import annotations

import json

import pytest

from hp.core.controller import Controller, ControllerConfig, JobState, Refused


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def running(nnodes: int = 2, nproc: int = 3, spares: int = 0, published: list | None = None,
            **cfg) -> tuple[Controller, Clock]:
    clock = Clock()
    publish = (lambda k, v: published.append((k, v))) if published is not None else None
    c = Controller(ControllerConfig(nnodes=nnodes, **cfg), clock=clock, publish=publish)
    for n in range(nnodes):
        c.handle("join", {"node_rank": n, "nproc": nproc, "host": f"h{n}", "spares": spares})
    return c, clock


def test_rendezvous_assigns_contiguous_ranks_by_node_rank():
    c = Controller(ControllerConfig(nnodes=2, store_host="10.0.0.1", store_port=5))
    c.handle("join", {"node_rank": 1, "nproc": 2, "host": "b"})
    assert c.handle("rendezvous", {"node_rank": 1})["state"] == "rendezvous"
    c.handle("join", {"node_rank": 0, "nproc": 3, "host": "a"})
    a0, a1 = (c.handle("rendezvous", {"node_rank": n}) for n in (0, 1))
    assert (a0["rank_offset"], a1["rank_offset"]) == (0, 3)
    assert a0["world_size"] == a1["world_size"] == 5
    assert a0["generation"] == 1 and a0["state"] == "running"
    assert (a0["store_host"], a0["store_port"]) == ("10.0.0.1", 5)


@pytest.mark.parametrize("payload, status", [
    ({"node_rank": 2, "nproc": 1, "host": "x"}, 400),  # outside [0, nnodes)
    ({"node_rank": 0, "nproc": 0, "host": "x"}, 400),
    ({"node_rank": "0", "nproc": 1, "host": "x"}, 400),  # wrong type
    ({"nproc": 1, "host": "x"}, 400),  # missing field
])
def test_malformed_join_is_refused_and_changes_nothing(payload, status):
    c = Controller(ControllerConfig(nnodes=2))
    with pytest.raises(Refused) as e:
        c.handle("join", payload)
    assert e.value.status == status
    assert c.nodes == {} and c.generation == 0
    assert c.decisions[-1]["decision"] == "refused"


def test_worker_failure_restarts_and_bumps_generation_until_budget_is_spent():
    c, _ = running(max_restarts=1)
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "signal": "SIGKILL", "pid": 7})
    assert d == {"action": "restart", "generation": 2, "rank": 4, "holder": "r4.1"}
    assert c.holders[4] == "r4.1"
    d = c.handle("worker_failed", {"node_rank": 0, "generation": 2, "rank": 0, "exitcode": 3, "pid": 8})
    assert d["action"] == "stop" and c.state is JobState.FAILED
    assert "rank 0 (node 0, pid 8) exited with code 3" in d["reason"]
    assert "restarts exhausted (1/1)" in d["reason"]


def test_report_with_an_old_generation_is_refused_and_logged(tmp_path):
    log = tmp_path / "decisions.jsonl"
    c, _ = running(max_restarts=5, decision_log=str(log))
    c.handle("worker_failed", {"node_rank": 0, "generation": 1, "rank": 0, "signal": "SIGKILL"})
    before = (c.generation, c.restarts)
    with pytest.raises(Refused) as e:  # node 1 still believes in generation 1
        c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 3, "signal": "SIGKILL"})
    assert e.value.status == 409 and e.value.extra == {"generation": 2}
    assert "stale generation 1 (current is 2)" in e.value.message
    assert (c.generation, c.restarts) == before
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["decision"] == "refused" and last["request"] == "worker_failed" and last["node_rank"] == 1


def test_future_generation_and_non_member_are_refused():
    c, _ = running()
    with pytest.raises(Refused, match="future generation 9"):
        c.handle("node_done", {"node_rank": 0, "generation": 9})
    with pytest.raises(Refused) as e:
        c.handle("heartbeat", {"node_rank": 7, "generation": 1})
    assert e.value.status == 403


def test_job_succeeds_when_every_node_is_done():
    c, _ = running()
    c.handle("node_done", {"node_rank": 0, "generation": 1})
    assert c.state is JobState.RUNNING
    c.handle("node_done", {"node_rank": 1, "generation": 1})
    assert c.state is JobState.SUCCEEDED


def test_silent_node_fails_the_job_after_the_heartbeat_timeout():
    c, clock = running(heartbeat_timeout_s=5)
    clock.now += 4
    c.handle("heartbeat", {"node_rank": 0, "generation": 1})
    c.check_liveness()
    assert c.state is JobState.RUNNING
    clock.now += 2  # node 1 silent for 6 s, node 0 for 2 s
    c.check_liveness()
    assert c.state is JobState.FAILED and "node 1 (h1) lost: no heartbeat for 6.0 s" in c.reason
    assert c.generation == 2  # ending the job is a membership change workers are told about


def test_a_running_job_refuses_late_joins():
    c, _ = running()
    with pytest.raises(Refused) as e:
        c.handle("join", {"node_rank": 0, "nproc": 3, "host": "h0"})
    assert e.value.status == 409


def test_unknown_request_is_refused():
    c, _ = running()
    with pytest.raises(Refused) as e:
        c.handle("drop_tables", {})
    assert e.value.status == 404


def test_a_failed_rank_goes_to_a_spare_of_its_own_node_first():
    published = []
    c, _ = running(spares=1, published=published)
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "signal": "SIGKILL"})
    assert d == {"action": "promote_spare", "spare": "n1s0", "rank": 4, "generation": 2}
    assert c.members[4] == 1 and sorted(c.free_spares) == ["n0s0"]
    # workers read the plan of generation 2, then the generation number, then the spare's rank
    keys = [k for k, _ in published]
    assert keys[-3:] == ["hp/plan/2", "hp/generation", "hp/spare/n1s0"]
    assert json.loads(dict(published)["hp/plan/2"])["world_size"] == 6
    assert json.loads(dict(published)["hp/spare/n1s0"]) == {"rank": 4, "generation": 2}


def test_a_spare_on_another_node_is_told_through_its_heartbeat():
    c, _ = running(spares=1)
    c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "signal": "SIGKILL"})
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 5, "signal": "SIGKILL"})
    assert d == {"action": "moved", "rank": 5, "node": 0, "generation": 3}
    assert c.members[5] == 0
    beat = c.handle("heartbeat", {"node_rank": 0, "generation": 3})
    assert beat["promotions"] == [{"spare": "n0s0", "rank": 5, "generation": 3}]
    assert c.handle("heartbeat", {"node_rank": 0, "generation": 3})["promotions"] == []
    d = c.handle("worker_failed", {"node_rank": 0, "generation": 3, "rank": 0, "signal": "SIGKILL"})
    assert d["action"] == "stop" and "no spare left (2 started) and restarts exhausted (0/0)" in d["reason"]


def test_a_rank_reports_only_ranks_it_holds():
    c, _ = running(spares=1)
    with pytest.raises(Refused) as e:
        c.handle("worker_failed", {"node_rank": 0, "generation": 1, "rank": 4, "signal": "SIGKILL"})
    assert e.value.status == 403 and c.generation == 1


def test_in_process_failures_reform_then_escalate():
    c, _ = running(max_rank_exceptions=2)
    for expected_generation in (2, 3):
        d = c.handle("rank_failed", {"node_rank": 0, "generation": expected_generation - 1, "rank": 1,
                                     "reason": "exception"})
        assert d == {"action": "reform", "generation": expected_generation}
    d = c.handle("rank_failed", {"node_rank": 0, "generation": 3, "rank": 1, "reason": "exception"})
    assert d["action"] == "exit" and c.generation == 3 and c.decisions[-1]["decision"] == "escalate"


def test_a_dead_spare_leaves_the_pool():
    c, _ = running(spares=1)
    c.handle("spare_failed", {"node_rank": 1, "spare": "n1s0"})
    assert sorted(c.free_spares) == ["n0s0"]


def test_a_report_from_a_replaced_process_is_refused():
    c, _ = running(spares=1)
    c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": "r4.0", "signal": "SIGKILL"})
    assert c.holders[4] == "spare.n1s0"
    with pytest.raises(Refused, match="stale holder 'r4.0'"):
        c.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 4, "holder": "r4.0", "exitcode": 1})
    assert sorted(c.free_spares) == ["n0s0"]

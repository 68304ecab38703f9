"""Controller decisions: rendezvous, generations, fencing, restart budget, liveness."""

from __future__ import annotations

import json

import pytest

from hp.core.controller import Controller, ControllerConfig, RecoveryPolicy, Refused
from hp.core.protocol import FailureAction, JobState, Verb


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
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL", "pid": 7})
    assert d == {"action": "restart", "generation": 2, "rank": 4, "holder": "r4.1"}
    assert c.holders[4] == "r4.1"
    d = c.handle("worker_failed", {"node_rank": 0, "generation": 2, "rank": 0, "holder": c.holders[0], "exitcode": 3, "pid": 8})
    assert d["action"] == "stop" and c.state is JobState.FAILED
    assert "rank 0 (node 0, pid 8) exited with code 3" in d["reason"]
    assert "restarts exhausted (1/1)" in d["reason"]


def test_report_with_an_old_generation_is_refused_and_logged(tmp_path):
    log = tmp_path / "decisions.jsonl"
    c, _ = running(max_restarts=5, decision_log=str(log))
    c.handle("worker_failed", {"node_rank": 0, "generation": 1, "rank": 0, "holder": c.holders[0], "signal": "SIGKILL"})
    before = (c.generation, c.restarts)
    with pytest.raises(Refused) as e:  # node 1 still believes in generation 1
        c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 3, "holder": c.holders[3], "signal": "SIGKILL"})
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
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})
    assert d == {"action": "promote_spare", "spare": "n1s0", "rank": 4, "generation": 2}
    assert c.members[4] == 1 and sorted(c.free_spares) == ["n0s0"]
    # workers read the plan of generation 2, then the generation number, then the spare's rank
    keys = [k for k, _ in published]
    assert keys[-3:] == ["hp/plan/2", "hp/generation", "hp/spare/n1s0"]
    assert json.loads(dict(published)["hp/plan/2"])["world_size"] == 6
    assert json.loads(dict(published)["hp/spare/n1s0"]) == {"rank": 4, "generation": 2}


def test_a_spare_on_another_node_is_told_through_its_heartbeat():
    c, _ = running(spares=1)
    c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 5, "holder": c.holders[5], "signal": "SIGKILL"})
    assert d == {"action": "moved", "rank": 5, "node": 0, "generation": 3}
    assert c.members[5] == 0
    beat = c.handle("heartbeat", {"node_rank": 0, "generation": 3})
    assert beat["promotions"] == [{"spare": "n0s0", "rank": 5, "generation": 3}]
    assert c.handle("heartbeat", {"node_rank": 0, "generation": 3})["promotions"] == []
    d = c.handle("worker_failed", {"node_rank": 0, "generation": 3, "rank": 0, "holder": c.holders[0], "signal": "SIGKILL"})
    assert d["action"] == "stop" and "no spare left (2 started) and restarts exhausted (0/0)" in d["reason"]


def test_a_rank_reports_only_ranks_it_holds():
    c, _ = running(spares=1)
    with pytest.raises(Refused) as e:
        c.handle("worker_failed", {"node_rank": 0, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})
    assert e.value.status == 403 and c.generation == 1


def test_in_process_failures_reform_then_escalate():
    c, _ = running(max_rank_exceptions=2)
    for expected_generation in (2, 3):
        d = c.handle("rank_failed", {"node_rank": 0, "generation": expected_generation - 1, "rank": 1, "holder": c.holders[1],
                                     "reason": "exception"})
        assert d == {"action": "reform", "generation": expected_generation}
    d = c.handle("rank_failed", {"node_rank": 0, "generation": 3, "rank": 1, "holder": c.holders[1], "reason": "exception"})
    assert d["action"] == "exit" and c.generation == 3 and c.decisions[-1]["decision"] == "escalate"


def test_a_dead_spare_leaves_the_pool():
    c, _ = running(spares=1)
    c.handle("spare_failed", {"node_rank": 1, "generation": c.generation, "spare": "n1s0"})
    assert sorted(c.free_spares) == ["n0s0"]


def test_a_report_from_a_replaced_process_is_refused():
    c, _ = running(spares=1)
    c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": "r4.0", "signal": "SIGKILL"})
    assert c.holders[4] == "spare.n1s0"
    with pytest.raises(Refused, match="stale holder 'r4.0'"):
        c.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 4, "holder": "r4.0", "exitcode": 1})
    assert sorted(c.free_spares) == ["n0s0"]



def test_every_state_changing_verb_is_fenced():
    """#14: holder fencing was optional and rank_failed, node_stopping, spare_* were not generation-fenced,
    so a stale or fenced process could still act. Each refusal below changes nothing."""
    c, _ = running(spares=1, max_restarts=1)
    for verb, payload in (("worker_failed", {"rank": 1, "signal": "SIGKILL"}),  # no holder: not optional any more
                          ("rank_failed", {"rank": 1, "reason": "exception"})):
        with pytest.raises(Refused, match="field 'holder'") as e:
            c.handle(verb, {"node_rank": 0, "generation": 1, **payload})
        assert e.value.status == 400
    c.handle("worker_failed", {"node_rank": 0, "generation": 1, "rank": 1, "holder": "r1.0", "signal": "SIGKILL"})
    assert c.holders[1] == "spare.n0s0" and c.generation == 2
    before = (c.generation, dict(c.holders), sorted(c.free_spares), c.rank_exceptions)
    # the replaced process (r1.0) reports an exception of its own step: it holds nothing now
    with pytest.raises(Refused, match="stale holder 'r1.0'") as e:
        c.handle("rank_failed", {"node_rank": 0, "generation": 2, "rank": 1, "holder": "r1.0", "reason": "exception"})
    assert e.value.status == 409
    # an agent that missed generation 2 cannot add, or strike off, spares
    for verb, spare in (("spare_added", "n0s1"), ("spare_failed", "n1s0")):
        with pytest.raises(Refused, match="stale generation 1") as e:
            c.handle(verb, {"node_rank": 0 if verb == "spare_added" else 1, "generation": 1, "spare": spare})
        assert e.value.status == 409 and e.value.extra["generation"] == 2
    # node_stopping naming a generation not made yet is forged; one naming an older one is a real stop
    with pytest.raises(Refused, match="unknown future generation 9"):
        c.handle("node_stopping", {"node_rank": 1, "generation": 9, "reason": "SIGTERM"})
    with pytest.raises(Refused, match="field 'generation'"):
        c.handle("node_stopping", {"node_rank": 1, "reason": "SIGTERM"})
    assert (c.generation, dict(c.holders), sorted(c.free_spares), c.rank_exceptions) == before
    assert c.state is JobState.RUNNING
    assert c.handle("node_stopping", {"node_rank": 1, "generation": 1, "reason": "SIGTERM"})["state"] == "failed"


# ---- node loss -------------------------------------------------------------------------------
def test_a_lost_node_s_ranks_go_to_spares_on_survivors_in_one_generation():
    published = []
    c, clock = running(nproc=2, spares=2, published=published, heartbeat_timeout_s=5)
    clock.now += 4
    c.handle("heartbeat", {"node_rank": 0, "generation": 1})
    clock.now += 2  # node 1 silent for 6 s
    c.check_liveness()
    assert c.state is JobState.RUNNING and c.generation == 2  # one bump for the whole node
    assert c.members == {0: 0, 1: 0, 2: 0, 3: 0}
    assert (c.holders[2], c.holders[3]) == ("spare.n0s0", "spare.n0s1")
    assert c.free_spares == {}  # node 1's own spares died with it
    beat = c.handle("heartbeat", {"node_rank": 0, "generation": 1})
    assert beat["promotions"] == [{"spare": "n0s0", "rank": 2, "generation": 2},
                                  {"spare": "n0s1", "rank": 3, "generation": 2}]
    plan = json.loads(dict(published)["hp/plan/2"])
    assert plan["why"] == "node_lost" and plan["world_size"] == 4
    assert json.loads(dict(published)["hp/spare/n0s1"]) == {"rank": 3, "generation": 2}
    # the lost node is refused from now on, whatever it asks: its agent fences itself
    with pytest.raises(Refused) as e:
        c.handle("heartbeat", {"node_rank": 1, "generation": 2})
    assert e.value.status == 410 and "node 1 was declared lost" in e.value.message
    c.check_liveness()
    assert c.generation == 2  # lost once, not again at every check
    c.handle("node_done", {"node_rank": 0, "generation": 2})
    assert c.state is JobState.SUCCEEDED  # a lost node is not waited for


def test_a_lost_node_without_enough_spares_on_survivors_fails_the_job_naming_it():
    c, clock = running(nproc=2, spares=1, heartbeat_timeout_s=5)
    clock.now += 4
    c.handle("heartbeat", {"node_rank": 0, "generation": 1})
    clock.now += 2
    c.check_liveness()
    assert c.state is JobState.FAILED
    assert c.reason == ("node 1 (h1) lost: no heartbeat for 6.0 s; its ranks [2, 3] need 2 spare(s) "
                        "on the surviving nodes, 1 free")


def test_a_node_the_scheduler_says_failed_is_lost_at_once_fenced_by_generation():
    """node_failed (the Slurm base job, as the operator): the node's ranks go to spares now, not a heartbeat
    timeout later; a report naming an old generation, a node not in the job or a malformed one changes
    nothing; a node already lost is left alone."""
    c, clock = running(nproc=2, spares=2, heartbeat_timeout_s=30)
    for payload, status, message in (({"node": 1, "generation": 0}, 409, "stale generation 0"),
                                     ({"node": 7, "generation": 1}, 404, "node 7 is not in the job"),
                                     ({"node": "1", "generation": 1}, 400, "field 'node'"),
                                     ({"node": 1}, 400, "field 'generation'")):
        with pytest.raises(Refused, match=message) as e:
            c.handle("node_failed", payload)
        assert e.value.status == status and c.generation == 1 and not c.nodes[1].lost
    answer = c.handle("node_failed", {"node": 1, "generation": 1, "reason": "Slurm took n2 out of job 7"})
    assert answer == {"lost": True, "generation": 2} and c.nodes[1].lost  # no time passed: told, not timed out
    assert (c.holders[2], c.holders[3]) == ("spare.n0s0", "spare.n0s1")
    lost = next(d for d in c.decisions if d["decision"] == "node_lost")
    assert lost["cause"] == "failed (Slurm took n2 out of job 7)"
    assert c.handle("node_failed", {"node": 1, "generation": 2}) == {"lost": False, "generation": 2}
    c2, _ = running(nproc=2, spares=0)
    c2.handle("node_failed", {"node": 1, "generation": 1, "reason": "Slurm took n2 out of job 7"})
    assert c2.state is JobState.FAILED and "node 1 (h1) lost: failed (Slurm took n2 out of job 7)" in c2.reason


def test_a_failure_report_about_an_earlier_run_of_a_node_changes_nothing():
    """node_failed naming an incarnation (a pod's uid; hp k8s watch) loses the node only if that is the run
    of the node the job has: a report about the pod that a new one replaced never hits the new one."""
    c = Controller(ControllerConfig(nnodes=2), clock=Clock())
    for n in range(2):
        c.handle("join", {"node_rank": n, "nproc": 1, "host": f"h{n}", "spares": 1, "incarnation": f"uid-{n}"})
    assert c.snapshot()["nodes"][1]["incarnation"] == "uid-1"
    answer = c.handle("node_failed", {"node": 1, "generation": 1, "incarnation": "uid-old", "reason": "pod deleted"})
    assert answer == {"lost": False, "generation": 1, "incarnation": "uid-1"} and not c.nodes[1].lost
    assert c.handle("node_failed", {"node": 1, "generation": 1, "incarnation": "uid-1"})["lost"] and c.nodes[1].lost
    for bad in (7, "x" * 129, "a\nb"):
        with pytest.raises(Refused, match="field 'incarnation'") as e:
            c.handle("node_failed", {"node": 0, "generation": 2, "incarnation": bad})
        assert e.value.status == 400 and not c.nodes[0].lost
        with pytest.raises(Refused, match="field 'incarnation'"):
            Controller(ControllerConfig(nnodes=1)).handle("join", {"node_rank": 0, "nproc": 1, "host": "h",
                                                                   "incarnation": bad})


def test_the_lost_node_address_is_reported_and_told_to_survivors():
    c = Controller(ControllerConfig(nnodes=2, heartbeat_timeout_s=5), clock=(clock := Clock()))
    for n in range(2):
        c.handle("join", {"node_rank": n, "nproc": 1, "host": "h", "spares": 1, "address": f"10.0.0.{n + 1}"})
    clock.now += 6
    c.handle("heartbeat", {"node_rank": 0, "generation": 1})  # refreshed just before the check
    c.check_liveness()
    assert "node 1 (h 10.0.0.2)" in c.decisions[-1]["cause"]
    assert c.handle("heartbeat", {"node_rank": 0, "generation": 2})["lost"] == ["10.0.0.2"]
    with pytest.raises(Refused, match="'address' must be str"):
        Controller(ControllerConfig(nnodes=1)).handle("join", {"node_rank": 0, "nproc": 1, "host": "h", "address": 5})


# ---- spare replenishment ---------------------------------------------------------------------
def test_an_added_spare_is_free_for_the_next_failure():
    c, _ = running(spares=1)
    c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})  # takes n1s0
    assert c.handle("spare_added", {"node_rank": 1, "generation": c.generation, "spare": "n1s1"}) == {"free_spares": 2}
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 5, "holder": c.holders[5], "signal": "SIGKILL"})
    assert d["action"] == "promote_spare" and d["spare"] == "n1s1"
    assert [x["decision"] for x in c.decisions].count("spare_added") == 1


@pytest.mark.parametrize("spare, status, message", [
    ("n0s5", 400, "must look like n1s<k>"),  # another node's id
    ("n1sx", 400, "must look like n1s<k>"),
    ("n1s0", 409, "already used"),  # ids are never reused: a store key per spare is final
])
def test_a_bad_added_spare_is_refused(spare, status, message):
    c, _ = running(spares=1)
    with pytest.raises(Refused) as e:
        c.handle("spare_added", {"node_rank": 1, "generation": c.generation, "spare": spare})
    assert e.value.status == status and message in e.value.message


# ---- spare readiness -------------------------------------------------------------------------
def test_a_ready_spare_is_promoted_before_one_still_starting_even_across_nodes():
    c, _ = running(spares=1)
    c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})  # takes n1s0
    c.handle("spare_added", {"node_rank": 1, "generation": c.generation, "spare": "n1s1"})  # starting: node 1's own, but not ready
    assert c.handle("spare_ready", {"node_rank": 0, "spare": "n0s0"}) == {"ready": True}
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 5, "holder": c.holders[5], "signal": "SIGKILL"})
    assert d == {"action": "moved", "rank": 5, "node": 0, "generation": 3}
    assert c.decisions[-1]["decision"] == "promote_spare" and c.decisions[-1]["ready"] is True
    assert c.snapshot()["ready_spares"] == [] and sorted(c.free_spares) == ["n1s1"]
    # with no ready spare left, the one still starting is used rather than failing the job
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 3, "rank": 3, "holder": c.holders[3], "signal": "SIGKILL"})
    assert d["action"] == "promote_spare" and d["spare"] == "n1s1"
    assert c.decisions[-1]["ready"] is False


def test_among_ready_spares_the_failed_rank_s_own_node_goes_first():
    c, _ = running(spares=2)
    for node, spare in [(0, "n0s0"), (1, "n1s1")]:
        c.handle("spare_ready", {"node_rank": node, "spare": spare})
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})
    assert d["spare"] == "n1s1"  # ready and local, before n1s0 (local, starting) and n0s0 (ready, remote)
    assert [x["spare"] for x in c.decisions if x["decision"] == "spare_ready"] == ["n0s0", "n1s1"]


def test_a_lost_node_s_ranks_take_ready_spares_first():
    c, clock = running(nproc=1, spares=2, heartbeat_timeout_s=5)
    c.handle("spare_ready", {"node_rank": 0, "spare": "n0s1"})
    clock.now += 6
    c.handle("heartbeat", {"node_rank": 0, "generation": 1})
    c.check_liveness()
    assert c.holders[1] == "spare.n0s1" and sorted(c.free_spares) == ["n0s0"]


@pytest.mark.parametrize("node, spare", [(1, "n0s0"), (0, "n0s7")])  # another node's spare; never added
def test_readiness_of_a_spare_that_is_not_free_there_changes_nothing(node, spare):
    c, _ = running(spares=1)
    assert c.handle("spare_ready", {"node_rank": node, "spare": spare}) == {"ready": False}
    assert c.snapshot()["ready_spares"] == [] and "spare_ready" not in [x["decision"] for x in c.decisions]


def test_a_promoted_or_dead_spare_is_no_longer_ready():
    c, _ = running(spares=1)
    for node in (0, 1):
        c.handle("spare_ready", {"node_rank": node, "spare": f"n{node}s0"})
    c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})
    c.handle("spare_failed", {"node_rank": 0, "generation": c.generation, "spare": "n0s0"})
    assert c.snapshot()["ready_spares"] == [] and c.free_spares == {}
    assert c.handle("spare_ready", {"node_rank": 1, "spare": "n1s0"}) == {"ready": False}  # late report


def test_finish_is_a_planned_generation_of_the_same_membership_that_every_later_plan_keeps():
    """`hp finish`: the ranks end after the next step their commit vote agrees on (hp.checkpointless); the
    controller's part is the plan. A second request changes nothing; a failure after it keeps it."""
    published = []
    c, _ = running(spares=1, published=published)
    holders = dict(c.holders)
    answer = c.handle("finish", {"node_rank": -1, "reason": "maintenance"})
    assert answer == {"finishing": True, "generation": 2}
    plan = json.loads(dict(published)["hp/plan/2"])
    assert plan["finishing"] is True and plan["at_boundary"] is True and plan["why"] == "finish"
    assert {int(r): h for r, h in plan["holders"].items()} == holders and c.state is JobState.RUNNING
    assert c.handle("finish", {}) == {"finishing": True, "generation": 2}  # asked again: the same answer
    c.handle("worker_failed", {"node_rank": 1, "generation": 2, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})
    later = json.loads(dict(published)["hp/plan/3"])
    assert later["finishing"] is True and later["at_boundary"] is False  # a recovery: the job still ends
    assert [d["reason"] for d in c.decisions if d["decision"] == "finish"] == ["maintenance"]
    for n in (0, 1):
        c.handle("node_done", {"node_rank": n, "generation": 3})
    assert c.state is JobState.SUCCEEDED


def test_finish_is_refused_unless_the_job_is_running():
    c = Controller(ControllerConfig(nnodes=2), clock=Clock())
    with pytest.raises(Refused, match="job is rendezvous"):
        c.handle("finish", {})
    assert c.finishing is False


# ---- the recovery policy: the decisions a Controller is given ----------------------------------------
class NoSpares(RecoveryPolicy):
    """A policy that keeps its spares for something else, answers a rank no spare takes itself, and
    serves ``scale`` (as an elastic policy would)."""

    def __init__(self, answer: dict | None = None) -> None:
        super().__init__()
        self.answer, self.asked = answer, []

    def pick_spare(self, node_rank: int) -> str | None:
        self.asked.append(("pick_spare", node_rank))
        return None

    def without_spare(self, ranks: list[int], cause: str) -> dict | None:
        self.asked.append(("without_spare", ranks, cause))
        return self.answer

    def spare_ready(self, spare: str) -> None:
        self.asked.append(("spare_ready", spare))

    def verbs(self):
        return {**super().verbs(), Verb.SCALE: lambda p: {"scaled": self.parts.book.generation}}


def with_policy(policy: RecoveryPolicy, **cfg) -> Controller:
    c = Controller(ControllerConfig(nnodes=2, **cfg), clock=Clock(), policy=policy)
    for n in range(2):
        c.handle("join", {"node_rank": n, "nproc": 2, "host": f"h{n}", "spares": 1})
    return c


def test_the_controller_consults_the_policy_it_is_given():
    policy = NoSpares()
    c = with_policy(policy, max_restarts=1)
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 3, "holder": c.holders[3],
                                   "signal": "SIGKILL"})
    assert d["action"] == FailureAction.RESTART  # a free spare, but the policy gave it no rank
    assert policy.asked == [("pick_spare", 1), ("without_spare", [3], "was killed by SIGKILL")]
    assert sorted(c.free_spares) == ["n0s0", "n1s0"]
    assert c.handle("spare_ready", {"node_rank": 0, "spare": "n0s0"}) == {"ready": True}
    assert policy.asked[-1] == ("spare_ready", "n0s0")
    assert c.handle("scale", {"replicas": 3}) == {"scaled": 2}  # a verb the policy serves
    with pytest.raises(Refused, match="fixed size"):  # and one it left to the default
        c.handle("node_leaving", {"node_rank": 0, "generation": 2})


def test_a_policys_answer_to_a_rank_no_spare_takes_is_the_controllers():
    c = with_policy(NoSpares({"action": "custom", "generation": 1}))
    d = c.handle("worker_failed", {"node_rank": 0, "generation": 1, "rank": 0, "holder": c.holders[0], "exitcode": 1})
    assert d == {"action": "custom", "generation": 1} and c.state is JobState.RUNNING and c.restarts == 0


def test_the_default_policy_is_the_fixed_size_one():
    c, _ = running(spares=1)
    assert type(c.policy) is RecoveryPolicy and c.policy.kind == "Controller"
    d = c.handle("worker_failed", {"node_rank": 1, "generation": 1, "rank": 4, "holder": c.holders[4], "signal": "SIGKILL"})
    assert d["action"] == FailureAction.PROMOTE_SPARE and d["spare"] == "n1s0"
    with pytest.raises(Refused, match="cannot join now"):
        c.handle("join", {"node_rank": 0, "nproc": 3, "host": "h0"})


def test_a_policy_serves_one_controller():
    policy = RecoveryPolicy()
    with pytest.raises(RuntimeError, match="not given to a controller"):
        policy.pick_spare(0)
    Controller(ControllerConfig(nnodes=1), policy=policy)
    with pytest.raises(ValueError, match="one controller"):
        Controller(ControllerConfig(nnodes=1), policy=policy)


def test_no_part_of_the_controller_reads_another_objects_private_attributes():
    """The parts share the job's book and each other's public methods, never a private attribute."""
    import ast
    import pathlib

    import hp.core.controller as package

    found = []
    for path in sorted(pathlib.Path(package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert found == []

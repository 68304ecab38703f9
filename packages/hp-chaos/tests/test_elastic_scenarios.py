"""Scenarios of elastic jobs: ``job.elastic``, ``expect.world_sizes`` / ``max_pause_s``, the ``preempt``
and ``join`` fault kinds, faults fired on an event (``at_event``), and the verdict on hand-made event
logs of a job whose world size changes. Every bad value is one ScenarioError naming its key."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from hp.chaos.faults import fault_kinds
from hp.chaos.faults.base import AtStep, ScenarioError
from hp.chaos.faults.elastic import JoinAt, PreemptAt
from hp.chaos.faults.process import SignalAt
from hp.chaos.finish import FinishAfter
from hp.chaos.launch import ELASTIC_TRAIN, JobRun, Live, _Tail, controller_command, demo_config, node_command
from hp.chaos.report import format_table
from hp.chaos.runner import evaluate
from hp.chaos.scenario import parse_scenario
from hp.checkpointless.demo.run import RunResult
from hp.testing import replaced

ELASTIC = {"min_replicas": 1, "max_replicas": 3, "global_batch": 8, "micro_batch": 2, "exact": True}
GOOD = {
    "name": "elastic-unit",
    "job": {"nodes": 2, "nproc_per_node": 1, "spares": 0, "steps": 40, "elastic": {**ELASTIC, "max_nodes": 3}},
    "faults": [{"at_step": 4, "kind": "kill", "target": "rank:1"},
               {"at_step": 6, "kind": "join", "target": "node:2"},
               {"at_step": 8, "kind": "preempt", "target": "node:1", "at_event": "pg_ready"}],
    "expect": {"completes": True, "bitwise_equal": True, "world_sizes": [2, 1, 2, 3, 2], "max_pause_s": 5},
}


def with_(path: str, value) -> dict:
    """GOOD with the value at a dotted path replaced; ``...`` deletes it."""
    return replaced(GOOD, path, value)


def test_an_elastic_scenario_parses():
    s = parse_scenario(GOOD)
    e = s.job.elastic
    assert (e.min_replicas, e.max_replicas, e.global_batch, e.micro_batch, e.exact) == (1, 3, 8, 2, True)
    assert e.max_nodes == 3
    assert s.job.max_nodes == 3 and s.job.shape.elastic and s.job.shape.all_nodes == 3
    kill, join, preempt = s.faults
    assert (kill.phase, kill.at_event) == ("forward", None)  # in process, at a phase
    assert (join.kind, str(join.target), join.at_event) == ("join", "node:2", None)
    assert (preempt.phase, preempt.at_event) == (None, "pg_ready")
    assert preempt.label() == "preempt of node:1 on pg_ready from step 8"
    assert s.expect.world_sizes == [2, 1, 2, 3, 2] and s.expect.max_pause_s == 5.0
    assert GOOD["job"]["elastic"]["max_nodes"] == 3  # the caller's mapping is left alone
    fixed = parse_scenario({**GOOD, "job": {k: v for k, v in GOOD["job"].items() if k != "elastic"},
                            "faults": GOOD["faults"][:1], "expect": {}})
    assert fixed.job.reference_key() != s.job.reference_key()
    assert len(fixed.job.reference_key()) == 7  # a fixed-size job's key (and its cached reference) is unchanged


@pytest.mark.parametrize("path, value, key", [
    ("job.elastic", 3, "job.elastic"),
    ("job.elastic.units", 2, "job.elastic.units"),
    ("job.elastic.min_replicas", 0, "job.elastic.min_replicas"),
    ("job.elastic.micro_batch", 0, "job.elastic.micro_batch"),
    ("job.elastic.exact", "yes", "job.elastic.exact"),
    ("job.elastic.max_replicas", 1, "job.elastic.max_replicas"),  # the job starts with 2 ranks
    ("job.elastic.global_batch", 7, "job.elastic.global_batch"),
    ("job.elastic.max_nodes", 1, "job.elastic.max_nodes"),
    ("job.elastic.min_replicas", 3, "job.elastic.min_replicas"),
    ("job.checkpoint", {"every": 2}, "job.elastic"),
    ("expect.world_sizes", 2, "expect.world_sizes"),
    ("expect.world_sizes", [], "expect.world_sizes"),
    ("expect.world_sizes", [2, 0], "expect.world_sizes"),
    ("expect.world_sizes", [2, "1"], "expect.world_sizes"),
    ("expect.world_sizes", [1, 2], "expect.world_sizes"),  # does not start at the job's 2 ranks
    ("expect.world_sizes", [2, 2, 3], "expect.world_sizes"),  # a size twice in a row is no change
    ("expect.world_sizes", [2, 4], "expect.world_sizes"),  # beyond max_replicas
    ("expect.max_pause_s", 0, "expect.max_pause_s"),
    ("expect.max_pause_s", "long", "expect.max_pause_s"),
    ("faults.2.target", "node:0", "faults[2].target"),  # node 0's agent hosts the controller
    ("faults.2.target", "node:3", "faults[2].target"),
    ("faults.2.at_event", "lunch", "faults[2].at_event"),
    ("faults.2.at_event", 3, "faults[2].at_event"),
    ("faults.2.signal", "SIGINT", "faults[2].signal"),
    ("faults.1.target", "node:1", "faults[1].target"),  # node 1 is in the job when it joins
    ("faults.1.target", "rank:0", "faults[1].target"),
    ("faults.0", {"at_step": 4, "kind": "kill", "target": "rank:1", "phase": "commit", "at_event": "rescaling"},
     "faults[0].phase"),
    ("faults.0", {"at_step": 4, "kind": "exception", "target": "rank:1", "at_event": "rescaling"},
     "faults[0].at_event"),
    ("faults.0", {"at_step": 4, "kind": "kill", "target": "rank:3"}, "faults[0].target"),  # 3 nodes x 1 rank at most
])
def test_a_malformed_elastic_scenario_names_the_key(path, value, key):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(with_(path, value))
    assert e.value.key == key and str(e.value).startswith(f"{key}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("fault, expect, key", [
    ({"at_step": 3, "kind": "preempt", "target": "node:1"}, {}, "faults[0].kind"),
    ({"at_step": 3, "kind": "join", "target": "node:1"}, {}, "faults[0].kind"),
    ({"at_step": 3, "kind": "kill", "target": "rank:1"}, {"world_sizes": [4]}, "expect.world_sizes"),
    ({"at_step": 3, "kind": "kill", "target": "rank:1"}, {"max_pause_s": 3}, "expect.max_pause_s"),
])
def test_elastic_keys_need_an_elastic_job(fault, expect, key):
    raw = {"name": "fixed", "job": {"nodes": 2, "nproc_per_node": 2, "steps": 20}, "faults": [fault], "expect": expect}
    with pytest.raises(ScenarioError) as e:
        parse_scenario(raw)
    assert e.value.key == key


@pytest.mark.parametrize("path, value", [("job.finish_after", 0), ("job.finish_after", "soon"),
                                         ("expect.world_sizes", ...)])  # what ends the run: its events
def test_a_run_time_end_needs_a_count_and_the_world_sizes_it_waits_for(path, value):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(replaced(with_("job.finish_after", 3), path, value))
    assert e.value.key == "job.finish_after"


def test_the_finish_waits_for_every_fault_then_the_world_sizes_then_steps_at_the_last():
    s = parse_scenario(with_("job.finish_after", 2))
    action, job = FinishAfter(s.faults, s.expect.world_sizes, 2), FakeJob()
    t = iter(range(1000))
    for world, steps in ((2, 4), (1, 2), (2, 2), (3, 2), (2, 1)):
        job.evs += [e for _ in range(steps) for e in commits(job.committed() + 1, float(next(t)), world, world)]
    assert not action.ready(job)  # no fault has fired yet
    job.evs += [{"t": 1.0, "event": "fault_injected", "kind": "kill", "phase": "forward", "step": 4, "rank": 1},
                {"t": 2.0, "event": "fault_injected", "kind": "join", "step": 6, "fault": 1}]
    job.evs += [e for e in commits(job.committed() + 1, float(next(t)), 2, 9)]
    assert not action.ready(job)  # the preempt (fault 2) has not
    job.evs += [{"t": 3.0, "event": "fault_injected", "kind": "preempt", "step": 8, "fault": 2}]
    assert not action.ready(job)  # nothing committed since it last looked
    job.evs += [e for e in commits(job.committed() + 1, float(next(t)), 2, 9)]
    assert action.ready(job)  # [2, 1, 2, 3, 2] and 3 steps at the last size (fault 0: the rank's own record)
    assert action.fire(job) is None and job.recorded[-1][0] == "finish"
    assert not FinishAfter(s.faults, s.expect.world_sizes, 4).ready(job)  # 3 steps at the last size, not 4


def test_a_node_joins_again_after_it_left_and_a_standalone_controller_lets_node_0_leave():
    again = with_("faults", [{"at_step": 5, "kind": "preempt", "target": "node:1"},
                             {"at_step": 9, "kind": "join", "target": "node:1"},
                             {"at_step": 12, "kind": "node", "target": "node:1"},
                             {"at_step": 14, "kind": "join", "target": "node:1"}])
    assert [f.kind for f in parse_scenario(again).faults] == ["preempt", "join", "node", "join"]
    twice = with_("faults", [{"at_step": 5, "kind": "preempt", "target": "node:1"},
                             {"at_step": 9, "kind": "join", "target": "node:1"},
                             {"at_step": 11, "kind": "join", "target": "node:1"}])
    with pytest.raises(ScenarioError, match=r"^faults\[2\]\.target: node 1 is in the job when it joins"):
        parse_scenario(twice)
    standalone = with_("job.controller", "standalone")
    standalone["faults"][2]["target"] = "node:0"
    assert str(parse_scenario(standalone).faults[2].target) == "node:0"


def test_each_elastic_kind_and_an_event_triggered_kill_inject_from_outside():
    kinds, s = fault_kinds(), parse_scenario(with_("faults", [
        {"at_step": 2, "kind": "join", "target": "node:2"},
        {"at_step": 3, "kind": "preempt", "target": "node:1"},
        {"at_step": 4, "kind": "kill", "target": "rank:1", "at_event": "rescaling"},
        {"at_step": 5, "kind": "hang", "target": "rank:0", "at_event": "hydrated", "duration_s": 1}]))
    join, preempt, kill, hang = (kinds[f.kind].inject(f, s.job.shape) for f in s.faults)
    assert isinstance(join.actions[0], JoinAt) and not join.hp_faults
    assert isinstance(preempt.actions[0], PreemptAt) and not preempt.hp_faults
    assert isinstance(kill.actions[0], SignalAt) and kill.actions[0].sig == signal.SIGKILL and not kill.hp_faults
    assert hang.actions[0].sig == signal.SIGSTOP and hang.actions[0].resume and not hang.hp_faults
    assert {"preempt", "join"} <= set(kinds) and kinds["preempt"].elastic_only and kinds["join"].event_trigger


class FakeJob:
    """A LiveJob for actions: events, rank 0's newest commit, agents by node."""

    def __init__(self) -> None:
        self.evs: list[dict] = []
        self.recorded: list[tuple[str, dict]] = []
        self.agents: dict[int, int | None] = {1: 4242}
        self.started: list[tuple[int, str]] = []

    def committed(self) -> int:
        return max((e["step"] for e in self.evs if e["event"] == "commit" and e["rank"] == 0), default=-1)

    def events(self) -> list[dict]:
        return self.evs

    def rank_pid(self, rank: int) -> int | None:
        return None

    def agent_pid(self, node: int) -> int | None:
        return self.agents.get(node)

    def start_agent(self, node: int, name: str) -> int:
        self.started.append((node, name))
        self.agents[node] = 777
        return 777

    def record(self, event: str, **fields) -> None:
        self.recorded.append((event, fields))

    def finish(self, reason: str) -> None:
        self.recorded.append(("finish", {"reason": reason}))


def test_an_event_triggered_fault_waits_for_its_step_then_for_the_event():
    spec = parse_scenario(with_("faults.2.at_step", 3)).faults[2]  # preempt on pg_ready from step 3
    action, job = AtStep(spec), FakeJob()
    job.evs += [{"t": 1.0, "event": "pg_ready", "rank": 0, "generation": 1}]
    job.evs += [{"t": 2.0 + s, "event": "commit", "rank": 0, "step": s} for s in range(2)]
    assert not action.ready(job)  # step 2 is not committed: the first pg_ready is too early anyway
    job.evs += [{"t": 4.0, "event": "commit", "rank": 0, "step": 2}]
    assert not action.ready(job)  # armed, no pg_ready since
    job.evs += [{"t": 4.5, "event": "pg_ready", "rank": 0, "generation": 2, "fault": 9}]  # the runner's own: ignored
    assert not action.ready(job)
    job.evs += [{"t": 4.6, "event": "pg_ready", "rank": 0, "generation": 2}]
    assert action.ready(job)


def test_join_waits_for_the_node_s_old_agent_and_preempt_sends_sigterm():
    s = parse_scenario(with_("faults.1", {"at_step": 9, "kind": "join", "target": "node:1"}))
    job = FakeJob()
    job.evs += [{"t": float(i), "event": "commit", "rank": 0, "step": i} for i in range(10)]
    join = JoinAt(s.faults[1])
    assert not join.ready(job)  # node 1's agent still runs
    job.agents[1] = None
    assert join.ready(job) and join.fire(job) is None
    assert job.started == [(1, "node1-join1")] and job.recorded[0][1]["pid"] == 777
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        job.agents[1] = sleeper.pid
        preempt = PreemptAt(parse_scenario(with_("faults.2.at_event", ...)).faults[2])
        assert preempt.ready(job)
        preempt.fire(job)
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
        assert job.recorded[-1] == ("fault_injected", {"kind": "preempt", "phase": None, "step": 8, "rank": None,
                                                       "target": "node:1", "fault": 2, "pid": sleeper.pid,
                                                       "node": 1, "signal": "SIGTERM"})
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_runner_knows_which_process_holds_a_rank_after_renumbering(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    lines = [{"t": 1.0, "pid": 10, "event": "pg_ready", "rank": 1, "generation": 1},
             {"t": 2.0, "pid": 11, "event": "pg_ready", "rank": 2, "generation": 1},
             {"t": 3.0, "pid": 99, "event": "fault_injected", "rank": 1, "generation": 2},  # not a holder
             {"t": 4.0, "pid": 11, "event": "pg_ready", "rank": 1, "generation": 2},  # renumbered
             {"t": 5.0, "pid": 10, "event": "released", "rank": 1, "generation": 1}]  # an old generation's
    (events / "w.jsonl").write_text("".join(__import__("json").dumps(e) + "\n" for e in lines))
    live = Live([], _Tail([str(events)]), None)
    live.update()
    assert live.rank_pid(1) == 11 and live.rank_pid(2) == 11 and live.rank_pid(0) is None
    assert live.agent_pid(0) is None


def test_an_elastic_job_runs_the_elastic_script_under_its_policy(tmp_path):
    s = parse_scenario(GOOD)
    argv = node_command(s.job, demo_config(s.job), str(tmp_path), 1, "10.0.0.1:29400", "/p/policy.yaml")
    joined = " ".join(argv)
    assert "--nnodes 2:3 --node-rank 1" in joined and "--scaling-policy /p/policy.yaml" in joined
    assert argv[argv.index("--tee") + 3] == ELASTIC_TRAIN and "--rdzv-endpoint 10.0.0.1:29400" in joined
    ctl = controller_command(s.job, "10.0.0.1", 29400, str(tmp_path), "/p/policy.yaml")
    assert ctl[ctl.index("--nnodes") + 1] == "2:3" and ctl[-2:] == ["--scaling-policy", "/p/policy.yaml"]
    fixed = parse_scenario({**GOOD, "job": {"nodes": 2, "nproc_per_node": 1}, "faults": GOOD["faults"][:1],
                            "expect": {}})
    argv = node_command(fixed.job, demo_config(fixed.job), str(tmp_path), 1, "10.0.0.1:29400")
    assert "hp.checkpointless.demo.train" in argv and "--nnodes" in argv and "2:" not in " ".join(argv)


# ---- the verdict of an elastic job, on hand-made event logs ------------------------------------------

DIGEST = {"params": "p", "buffers": "b", "optimizer": "o"}


def commits(step: int, t: float, world: int, generation: int, ranks: range | None = None, loss: float | None = None,
            pid0: int = 100) -> list[dict]:
    loss = 5.0 - step / 10 if loss is None else loss
    return [{"t": t + r * 1e-3, "pid": pid0 + r, "event": "commit", "rank": r, "step": step, "generation": generation,
             "world": world, "loss": loss.hex()} for r in (ranks or range(world))]


def final(world: int, t: float, digest: dict = DIGEST) -> list[dict]:
    return [{"t": t, "pid": 100 + r, "event": "final_state", "rank": r, "step": 11, "digests": digest}
            for r in range(world)]


def reference_run() -> RunResult:
    ev = [e for s in range(12) for e in commits(s, float(s), 2, 1)]
    return RunResult(0, 12.0, ev + final(2, 12.0), "")


def shrink_and_grow(odd_loss_at: int | None = None, digest: dict = DIGEST, agent_exit: int = 0) -> JobRun:
    """2 ranks, rank 1 killed at step 4 (shrink to 1), grown back to 2 before step 8, then node 1 preempted
    (its agent, pid 55) before step 10: world 2 -> 1 -> 2 -> 1; one step = 1 s."""
    ev = [e for s in range(4) for e in commits(s, float(s), 2, 1)]
    ev += [{"t": 3.5, "pid": 101, "event": "fault_injected", "kind": "kill", "phase": "forward", "step": 4, "rank": 1},
           {"t": 3.6, "pid": 100, "event": "failure_detected", "step": 4, "rank": 0, "generation": 1}]
    ev += [e for s in range(4, 8) for e in commits(s, s + 0.5, 1, 2)]
    ev += [{"t": 7.6, "pid": 100, "event": "rescaling", "rank": 0, "step": 7, "generation": 2}]
    ev += [e for s in range(8, 10) for e in commits(s, s + 1.0, 2, 3,
                                                    loss=5.0 - s / 10 + (1e-9 if s == odd_loss_at else 0))]
    ev += [{"t": 9.2, "pid": 55, "event": "fault_injected", "kind": "preempt", "phase": None, "step": 10, "rank": None,
            "target": "node:1", "fault": 1}]
    ev += [e for s in range(10, 12) for e in commits(s, s + 1.5, 1, 4)]
    ev += final(1, 13.0, digest)
    return JobRun(RunResult(0, 14.0, sorted(ev, key=lambda e: e["t"]), ""), False, 0, [], [0, agent_exit], [1, 55])


SHRINK = {"name": "elastic-verdict", "job": {"nodes": 2, "nproc_per_node": 1, "spares": 0, "steps": 12,
                                              "elastic": {**ELASTIC, "max_replicas": 2}},
          "faults": [{"at_step": 4, "kind": "kill", "target": "rank:1"},
                     {"at_step": 10, "kind": "preempt", "target": "node:1"}]}


def elastic_verdict(expect: dict, run: JobRun | None = None) -> dict:
    return evaluate(parse_scenario({**SHRINK, "expect": expect}), reference_run(), run or shrink_and_grow())


def test_world_sizes_pauses_and_every_rank_s_bits():
    r = elastic_verdict({"bitwise_equal": True, "lost_steps": 0, "world_sizes": [2, 1, 2, 1], "max_pause_s": 1.0})
    assert r["passed"], r["failures"]
    e = r["elastic"]
    assert e["world_sizes"] == [2, 1, 2, 1] and [c["kind"] for c in e["scale_events"]] == ["shrink", "grow", "preempt"]
    # each pause: the gap (1.5 s) - the median step time at the new size (1 s)
    assert e["pause_s"] == [pytest.approx(0.5, abs=0.01)] * 3
    assert e["losses_equal"] and e["state_equal"] and r["bitwise_equal"]
    assert r["faults"][1]["agent_exit"] == 0
    table = format_table(r)
    assert "2 -> 1 -> 2 -> 1" in table and "grow 1 -> 2" in table and "every rank's final state" in table


@pytest.mark.parametrize("expect, run, unmet", [
    ({"world_sizes": [2, 1, 2]}, None, "world_sizes: expected [2, 1, 2], got [2, 1, 2, 1]"),
    ({"bitwise_equal": True}, shrink_and_grow(odd_loss_at=9), "bitwise_equal: expected True, got False (steps whose "
                                                              "losses (any rank) differ or are missing: [9]"),
    ({"bitwise_equal": True}, shrink_and_grow(digest={**DIGEST, "optimizer": "x"}),
     "bitwise_equal: expected True, got False (steps whose losses (any rank) differ or are missing: []; final "
     "state: rank 0 optimizer: not the reference's"),
    ({}, shrink_and_grow(agent_exit=143), "faults[1] (preempt of node:1 at step 10): the preempted agent exited 143"),
])
def test_each_unmet_elastic_expectation_is_named(expect, run, unmet):
    r = elastic_verdict(expect, run)
    assert not r["passed"] and len(r["failures"]) == 1 and r["failures"][0].startswith(unmet), r["failures"]


def test_every_scale_event_s_pause_is_checked():
    r = elastic_verdict({"max_pause_s": 0.4})
    assert [f.split(" expected")[0] for f in r["failures"]] == [
        "max_pause_s: the shrink 2 -> 1 before step 4", "max_pause_s: the grow 1 -> 2 before step 8",
        "max_pause_s: the preempt 2 -> 1 before step 10"]
    assert r["failures"][0].endswith("expected <= 0.4 s, got 0.499 s")


def test_a_pause_without_a_pace_at_the_new_size_counts_its_whole_gap():
    """2 ranks, one step at 3 (nothing to take a step time from), back to 2."""
    ev = [e for s in range(4) for e in commits(s, float(s), 2, 1)] + commits(4, 5.5, 3, 2)
    ev += [e for s in range(5, 8) for e in commits(s, s + 2.0, 2, 3)]
    run = JobRun(RunResult(0, 10.0, ev + final(2, 10.0), ""), False, 0, [], [0], [1])
    raw = {**SHRINK, "job": {**SHRINK["job"], "steps": 8, "elastic": {**ELASTIC, "max_nodes": 3}},
           "faults": [{"at_step": 1, "kind": "join", "target": "node:2"}]}
    ref = RunResult(0, 8.0, [e for s in range(8) for e in commits(s, float(s), 2, 1)] + final(2, 8.0), "")
    r = evaluate(parse_scenario({**raw, "expect": {"max_pause_s": 2.0}}), ref, run)
    grow, back = r["elastic"]["scale_events"]
    assert (grow["pause_s"], grow["gap_s"], back["pause_s"]) == (None, 2.501, pytest.approx(0.5, abs=0.01))
    assert [f for f in r["failures"] if f.startswith("max_pause_s")] == [
        "max_pause_s: the grow 2 -> 3 before step 4 expected <= 2.0 s, got 2.501 s"]


def test_a_grown_rank_is_compared_with_the_reference_s_rank_0():
    run = shrink_and_grow()
    run.result.events[:] = [e for e in run.result.events if e["event"] != "final_state"] + final(3, 13.0)
    assert elastic_verdict({"bitwise_equal": True}, run)["passed"]
    run.result.events[-1] = {**run.result.events[-1], "digests": {**DIGEST, "params": "other"}}
    r = elastic_verdict({"bitwise_equal": True}, run)
    assert not r["passed"] and "rank 2 params: not the reference's" in r["failures"][0]


def test_hp_chaos_faults_lists_the_elastic_kinds():
    from hp.testing import HP

    out = subprocess.run([*HP, "chaos", "faults", "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["kind"]: r for r in __import__("json").loads(out)}
    assert rows["preempt"]["targets"] == ["node"] and rows["join"]["targets"] == ["node"]
    assert "SIGTERM" in rows["preempt"]["doc"] and "joins the running job" in rows["join"]["doc"]


def test_a_job_that_should_end_at_run_time_and_ran_to_its_last_step_is_named():
    scenario = parse_scenario({**SHRINK, "job": {**SHRINK["job"], "finish_after": 2},
                               "expect": {"world_sizes": [2, 1, 2, 1]}})
    r = evaluate(scenario, reference_run(), shrink_and_grow())
    assert r["failures"] == ["finish_after: the job ran to its last step (12) instead of ending 2 steps after "
                             "its events (hp finish)"] and r["finished_at"] is None
    run = shrink_and_grow()
    run.result.events.append({"t": 12.6, "pid": 100, "event": "finish_agreed", "rank": 0, "step": 11})
    r = evaluate(scenario, reference_run(), run)
    assert r["passed"] and (r["finished_at"], r["steps"]) == (11, 12), r["failures"]

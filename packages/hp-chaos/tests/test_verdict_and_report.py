"""The verdict arithmetic on hand-made event logs (every expectation can fail), and the report:
a PNG people can read and a table, from ``hp chaos report RESULT.json``; bad input is exit 2."""

from __future__ import annotations

import json
import subprocess

import pytest
from hp.chaos.launch import JobRun
from hp.chaos.runner import evaluate, goodput, write_result
from hp.chaos.scenario import parse_scenario
from hp.checkpointless.demo.run import RunResult
from hp.testing import HP
from PIL import Image

GEN = 1


def commit(t: float, step: int, loss: float, generation: int = GEN) -> dict:
    return {"t": t, "event": "commit", "rank": 0, "step": step, "generation": generation, "loss": loss.hex()}


FINAL = {"t": 8.0, "event": "final_state", "rank": 0, "step": 7, "digests": {"params": "p", "optimizer": "o"}}


def reference() -> RunResult:
    return RunResult(0, 10.0, [commit(float(s), s, 5.0 - s / 10) for s in range(8)] + [FINAL], "")


def faulted(changed_step: int | None = None, returncode: int = 0) -> JobRun:
    """Steps 0..7 at 1 s each; rank 1 killed at step 4's all-reduce, back 0.5 s later in generation 2."""
    ev = [commit(float(s), s, 5.0 - s / 10) for s in range(4)]
    ev += [{"t": 3.5, "event": "fault_injected", "kind": "kill", "phase": "allreduce", "step": 4, "rank": 1, "pid": 9},
           {"t": 3.6, "event": "failure_detected", "step": 4, "rank": 0, "generation": 1},
           {"t": 3.7, "event": "released", "generation": 1, "rank": 0},
           {"t": 3.8, "event": "pg_ready", "generation": 2, "rank": 0},
           {"t": 3.9, "event": "resumed", "generation": 2, "rank": 0, "step": 3}]
    ev += [commit(0.5 + s, s, 5.0 - s / 10 + (1e-9 if s == changed_step else 0.0), 2) for s in range(4, 8)]
    ev.append({**FINAL, "t": 8.5})
    return JobRun(RunResult(returncode, 12.0, ev, "hp run: job failed: rank 1 died\n"), False, 0, [])


SCENARIO = {"name": "unit", "job": {"steps": 8}, "faults": [{"at_step": 4, "kind": "kill", "target": "rank:1",
                                                              "phase": "allreduce"}]}


def verdict(expect: dict, run: JobRun | None = None, ref: RunResult | None = None) -> dict:
    return evaluate(parse_scenario({**SCENARIO, "expect": expect}), ref or reference(), run or faulted())


def test_a_recovered_fault_meets_every_expectation():
    r = verdict({"completes": True, "bitwise_equal": True, "lost_steps": 0, "max_recovery_s": 1.5,
                 "min_goodput": 0.8, "recoveries": 1})
    assert r["passed"] and r["failures"] == []
    assert r["recovery_s"] == [pytest.approx(1.0)]  # 3.5 -> first commit of generation 2 at 4.5
    assert r["faults"][0]["phases"] == pytest.approx({"detect": 0.1, "abort": 0.1, "pg_init": 0.1, "hydrate": 0.1,
                                                      "replay": 0.6})
    # the fault at 3.5 s cost the wall time from the last commit before it (3.0) to the next (4.5) less
    # one step at the run's median pace (1 s): 0.5 s of a 7.5 s window (first to last commit)
    assert r["goodput"] == pytest.approx(1 - 0.5 / 7.5) == goodput(faulted().result, [(3.5, 0.0, 4)])
    assert goodput(faulted().result, []) == 1.0  # no fault, no cost, whatever the jitter
    # an outage lasting 2 s from 3.5: its aftermath runs to the first commit after 5.5 (6.5): 3.5 s of
    # wall time for 3 steps
    assert goodput(faulted().result, [(3.5, 2.0, 4)]) == pytest.approx(1 - 0.5 / 7.5)
    assert r["recoveries"] == 1 and r["losses"]["faulted"]["7"] == [pytest.approx(4.3)]


def test_a_straggler_is_charged_even_when_rank_0_commits_the_previous_step_after_it_fired():
    """A fresh-clone run: rank 1 entered step 2 and was slowed 1 s while rank 0 still committed step 1,
    5 ms after the fault; an aftermath ending at that commit charged nothing (goodput 1.0)."""
    times = [0.0, 0.111, 1.118, 2.168, 2.252, 2.320]  # commits of steps 0..5; the fault at 0.106, in step 2
    run = RunResult(0, 3.0, [commit(t, s, 1.0) for s, t in enumerate(times)], "")
    # from step 0's commit to step 2's: 1.118 s for 2 steps at the median pace (0.111 s)
    assert goodput(run, [(0.106, 0.0, 2)]) == pytest.approx(1 - (1.118 - 2 * 0.111) / 2.32)


@pytest.mark.parametrize("expect, run, unmet", [
    ({"max_recovery_s": 0.5}, None, "max_recovery_s: faults[0] (kill of rank:1 at step 4 (allreduce)) expected <= 0.5"),
    ({"bitwise_equal": True}, faulted(changed_step=6), "bitwise_equal: expected True, got False (steps whose losses "
                                                       "(any rank) differ or are missing: [6]; final state: equal)"),
    ({"min_goodput": 0.99}, None, "min_goodput: expected >= 0.99, got 0.933"),
    ({"recoveries": 0}, None, "recoveries: expected <= 0, got 1"),
    ({"completes": True}, faulted(returncode=1), "completes: the faulted job failed (exit 1): hp run: job failed"),
    ({"completes": False}, None, "completes: expected the faulted job to fail, it completed"),
    ({"completes": False, "error_contains": "controller"}, faulted(returncode=1), "error_contains: 'controller'"),
])
def test_each_unmet_expectation_is_named(expect, run, unmet):
    r = verdict(expect, run)
    assert not r["passed"] and len(r["failures"]) == 1 and r["failures"][0].startswith(unmet), r["failures"]


def test_a_fault_that_never_fired_fails_the_scenario():
    run = faulted()
    run.result.events[:] = [e for e in run.result.events if e["event"] != "fault_injected"]
    r = verdict({}, run)
    assert r["failures"] == ["faults[0] (kill of rank:1 at step 4 (allreduce)) never fired"]
    assert r["recovery_s"] == [None]


def test_a_lost_step_is_counted():
    run = faulted()
    run.result.events.append(commit(7.9, 7, 4.3, 3))  # step 7 committed again, in a later generation
    r = verdict({"lost_steps": 0}, run)
    assert r["lost_steps"] == 1 and r["failures"] == ["lost_steps: expected <= 0, got 1"]


def test_bit_equality_is_every_rank_s_own_loss_and_final_state_whichever_ranks_committed_a_step():
    ref, run = reference(), faulted()
    for e in ref.events + run.result.events:  # rank 0's own loss; rank 1's commits beside rank 0's
        if e["event"] == "commit":
            e["local"] = {"0": "0x1.0p+0", "1": "0x1.8p+0"}
    ref.events += [{**e, "rank": 1} for e in ref.events if e["event"] == "commit"] + [{**FINAL, "rank": 1}]
    run.result.events += [{**e, "rank": 1} for e in run.result.events if e["event"] == "commit"] + [{**FINAL, "rank": 1}]
    assert verdict({"bitwise_equal": True}, run, ref)["passed"]
    # rank 0 hydrated past step 6 (it failed after the vote): rank 1's commit still covers the step
    run.result.events[:] = [e for e in run.result.events if not (e["event"] == "commit" and e["step"] == 6
                                                                 and e["rank"] == 0)]
    assert verdict({"bitwise_equal": True}, run, ref)["passed"]
    # one rank's own loss of one step differs, while the global mean is the same bits
    next(e for e in run.result.events if e["event"] == "commit" and e["step"] == 5 and e["rank"] == 1)["local"] = \
        {"0": "0x1.0p+0", "1": "0x1.8000000000001p+0"}
    r = verdict({"bitwise_equal": True}, run, ref)
    assert r["failures"] == ["bitwise_equal: expected True, got False (steps whose losses (any rank) differ or are "
                             "missing: [5]; final state: equal)"]
    # every loss the same bits, one rank's final weights one ulp off
    run = faulted()
    run.result.events[-1] = {**FINAL, "t": 8.5, "digests": {"params": "p+1ulp", "optimizer": "o"}}
    r = verdict({"bitwise_equal": True}, run)
    assert not r["passed"] and "rank 0 params: not the reference's" in r["failures"][0]


def test_hp_chaos_report_writes_a_png_and_prints_the_table(tmp_path):
    result = verdict({"max_recovery_s": 0.5})
    result["log_dir"] = str(tmp_path)
    write_result(result, str(tmp_path / "result.json"))
    out = subprocess.run([*HP, "chaos", "report", str(tmp_path / "result.json")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    png = tmp_path / "result.png"
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] >= 800 and img.size[1] >= 600
        assert len(set(img.convert("RGB").getdata())) > 20  # drawn on, not a blank canvas
    rows = {line[:38].strip(): line[38:].strip() for line in out.stdout.splitlines()}
    assert rows["verdict"] == "FAILED" and rows["kill of rank:1 at step 4 (allreduce)"] == "recovery 1.000 s"
    assert rows["unmet"].startswith("max_recovery_s: faults[0]") and rows["replay"] == "600 ms"
    assert f"picture written to {png}" in out.stdout


@pytest.mark.parametrize("content, message", [
    (None, "No such file or directory"),
    ("{not json", "Expecting property name"),
    (json.dumps({"name": "x"}), "not a scenario result (from `hp chaos run --json`): missing passed"),
])
def test_hp_chaos_report_bad_input_is_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    out = subprocess.run([*HP, "chaos", "report", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "r.png").exists()


def test_an_absorbed_fault_lasts_until_its_own_step_commits():
    """A fast rank can enter step 4 (and go slow there) before rank 0 has recorded step 3's commit."""
    ev = [commit(float(s), s, 5.0 - s / 10) for s in range(8)]
    ev.append({"t": 2.95, "event": "fault_injected", "kind": "slow", "phase": "forward", "step": 4, "rank": 3,
               "pid": 9})
    run = JobRun(RunResult(0, 9.0, sorted(ev, key=lambda e: e["t"]), ""), False, 0, [])
    r = evaluate(parse_scenario({**SCENARIO, "faults": [{"at_step": 4, "kind": "slow", "target": "rank:3"}],
                                 "expect": {"recoveries": 0}}), reference(), run)
    assert r["passed"] and r["recovery_s"] == [pytest.approx(4.0 - 2.95)]
    assert r["faults"][0]["phases"] == {"replay": pytest.approx(1.05)}


def test_an_absorbed_fault_followed_by_another_fault_before_any_commit_still_ends_at_its_step_s_commit():
    """Seen in CI under load: rank 2 hung (resumed: nothing failed) at step 4, then a late spare's own fault
    fired before any commit; the first fault's cost still ends at step 4's commit, not "no commit after it"."""
    ev = [commit(float(s), s, 5.0 - s / 10) for s in range(8)]
    ev += [{"t": 3.10, "event": "fault_injected", "kind": "hang", "phase": "forward", "step": 4, "rank": 2, "pid": 9},
           {"t": 3.15, "event": "fault_injected", "kind": "hang", "phase": None, "step": 1, "rank": None, "pid": 8}]
    run = JobRun(RunResult(0, 9.0, sorted(ev, key=lambda e: e["t"]), ""), False, 0, [])
    r = evaluate(parse_scenario({**SCENARIO, "faults": [{"at_step": 4, "kind": "hang", "target": "rank:2",
                                                         "duration_s": 1.0}],
                                 "expect": {"recoveries": 0, "max_recovery_s": 5.0}}), reference(), run)
    assert r["passed"], r["failures"]
    assert r["recovery_s"] == [pytest.approx(4.0 - 3.10)] and r["faults"][0]["phases"] == {"replay": pytest.approx(0.9)}


def test_a_bit_mismatch_says_whether_the_fault_free_run_reproduces():
    """A shared reference that came out other bits failed six scenarios in CI, each blaming its recovery:
    on a mismatch the runner runs the fault-free job again and names which it is."""
    from hp.chaos.reproducible import reference_recheck

    ref = reference()
    assert reference_recheck(ref, reference).endswith("has the reference's bits: the faults changed them")
    nudged = [{**e, "loss": (5.0 - e["step"] / 10 + 1e-9).hex()} if e["event"] == "commit" and e["step"] >= 3 else e
              for e in ref.events]
    other = [{**e, "digests": {"params": "q", "optimizer": "o"}} if e["event"] == "final_state" else e
             for e in nudged]
    said = reference_recheck(ref, lambda: RunResult(0, 10.0, other, ""))
    assert "does not have the reference's bits either (steps [3, 4, 5, 6, 7]; rank 0 params" in said
    assert said.endswith("not deterministic without faults (intra-op threads? see hp-checkpointless's README)")
    assert "failed (exit 3)" in reference_recheck(ref, lambda: RunResult(3, 1.0, [], "boom"))


def test_the_runner_rechecks_the_reference_only_on_a_bit_mismatch(tmp_path, monkeypatch):
    from hp.chaos import references, runner

    refs: list[str] = []

    def fake_reference(job, log_dir, env):
        refs.append(log_dir)
        return reference() if len(refs) == 1 else RunResult(0, 10.0, faulted(changed_step=6).result.events, "")

    monkeypatch.setattr(references, "fault_free_run", fake_reference)  # the cache's first run
    monkeypatch.setattr(runner, "fault_free_run", fake_reference)  # the runner's second look
    for changed, calls in ((None, 1), (5, 2)):
        refs.clear()
        monkeypatch.setattr(runner, "run_job", lambda *a, changed=changed, **kw: faulted(changed_step=changed))
        r = runner.run_scenario(parse_scenario({**SCENARIO, "expect": {"bitwise_equal": True}}), str(tmp_path))
        assert len(refs) == calls, refs  # the fault-free job again only when the bits differ
        if changed is None:
            assert r["passed"], r["failures"]
        else:
            [f] = [f for f in r["failures"] if f.startswith("bitwise_equal:")]
            assert "; a second fault-free run does not have the reference's bits either (steps [6])" in f
            assert refs[1] == str(tmp_path / "reference-again")

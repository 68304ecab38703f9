"""An elastic hp job following a real Slurm (issue #15): ``hp slurm submit`` on a local Slurm of four fake
nodes (munged, slurmctld, four slurmd; hp.chaos.clusters.slurm), driven only through Slurm: another tenant's
job leaving (grow 2 -> 4), a high-priority job preempting the units (4 -> 2 within the grace time), that job
ending (back to 4), a node set DOWN (4 -> 3); both shrinks at a step boundary, though Slurm signals every
process of a step. No Slurm command is mocked and no hp process is signalled by the test. Exact mode: every step's loss and every rank's final weights and optimizer state must equal a
fixed-size run's."""

from __future__ import annotations

import itertools
import json

import pytest

from hp.chaos.slurm_elastic import SlurmElasticConfig, run_slurm_elastic, timings

# a Slurm job has its own deadline (SlurmElasticConfig.timeout_s, 480 s) and says what it was waiting for;
# pytest's default 300 s cut a slow run (two of these side by side: one took 307 s) before it could say
pytestmark = pytest.mark.timeout(600)
# half the default's samples per step (12 micro-batches of 2): the events take as long, the steps around them
# and the fixed-size reference half as long
BATCH = {"global_batch": 24, "micro_batch": 2}


def _ended_at_run_time(r: dict) -> bool:
    """The job ended `finish_after` steps after its last event (hp finish, agreed by every rank), before the
    most it could run; the reference ran to the same step."""
    return r["finished_at"] is not None and r["finished_at"] == r["steps"] - 1 < r["max_steps"] - 1


def _turns(sizes: list[int]) -> list[int]:
    """The world sizes where the direction changes (2, 3, 4, 2, 3, 4, 3 -> 2, 4, 2, 4, 3)."""
    out = [k for k, _ in itertools.groupby(sizes)]
    return [w for i, w in enumerate(out) if i in (0, len(out) - 1) or (out[i - 1] < w) != (w < out[i + 1])]


def test_grow_preempt_regrow_and_node_down_bit_identical(tmp_path, chaos_reference_cache):
    # a grace time of 20 s: a loaded 2-core box (a fresh-clone suite run) took more than 10 s to tear a preempted
    # unit's processes down after its rank had left (0.7 s after the notice), and Slurm recorded TIMEOUT
    r = run_slurm_elastic(SlurmElasticConfig(log_dir=str(tmp_path), steps=400, grace_s=20, **BATCH), chaos_reference_cache)
    brief = {k: r.get(k) for k in ("error", "steps", "finished_at", "world_sizes", "marks", "units", "base_state", "shrink_s", "grow_s",
                                   "state_differences", "error_tail")}
    assert r["completed"], json.dumps(brief, indent=1)
    turns = _turns(r["world_sizes"])  # 3 first when a unit's node was up before the job's first step
    assert turns[0] in (2, 3) and turns[1:] == [4, 2, 4, 3], brief
    assert r["lost_steps"] == 0 and _ended_at_run_time(r), brief
    assert r["losses_equal"] and r["state_equal"] and r["bitwise_equal"], brief
    # the preempted units' ranks left within the unit partition's grace time, and their jobs ended by themselves
    assert len(r["shrink_s"]) == 1 and r["shrink_s"][0] < r["grace_s"], brief
    # at a step boundary, not by dying mid-step: Slurm signals every process of the step, and the workers
    # leave SIGTERM to their agent (hp.core.worker_signals); a "shrink" here would be a rank lost mid-step
    assert [e["kind"] for e in r["events"] if e["to"] < e["from"]] == ["preempt", "preempt"], r["events"]
    assert len(r["grow_s"]) == 2, brief
    states = [state for _, state in r["units"].values()]
    assert "NODE_FAIL" in states and states.count("COMPLETED") >= 2, brief  # the DOWN node's unit; the preempted


def test_the_job_grows_to_its_qos_quota_then_into_the_raised_quota(tmp_path, chaos_reference_cache):
    """Slurm accounting (MariaDB + slurmdbd) enforcing a QOS that lets the user hold 3 of the 4 nodes: the
    2-node base grows by one unit, the other waits for the quota (Slurm's reason), and capacity() says 3;
    the quota raised to 4, the waiting unit starts and the job grows to 4. Bit-identical to a 4-rank run."""
    r = run_slurm_elastic(SlurmElasticConfig(log_dir=str(tmp_path), steps=300, quota=3, node_down=False, **BATCH),
                          chaos_reference_cache)
    brief = {k: r.get(k) for k in ("error", "steps", "finished_at", "world_sizes", "marks", "units", "base_state", "grow_s",
                                   "base_capacity_log", "state_differences", "error_tail")}
    assert r["completed"], json.dumps(brief, indent=1)
    # 3 first when the unit within the quota was up before the job's first step (seen under load)
    assert r["world_sizes"] in ([2, 3, 4], [3, 4]), brief
    assert r["lost_steps"] == 0 and r["bitwise_equal"] and _ended_at_run_time(r), brief
    at_quota, raised = [m for m in r["marks"] if m["kind"] == "capacity_read"]
    assert (at_quota["hosts"], at_quota["quota_hosts"]) == (3, 3), brief
    assert at_quota["waiting"] == ["QOSMaxNodePerUserLimit"], brief
    assert (raised["hosts"], raised["quota_hosts"], raised["waiting"]) == (4, 4, []), brief
    assert len(r["grow_s"]) == 1, brief  # from the quota raised to the first commit at 4
    assert any("QOS quota 3" in line for line in r["base_capacity_log"]), brief  # the base job saw it too


def test_a_failed_base_node_is_replaced_and_the_job_never_stops(tmp_path, chaos_reference_cache):
    """Five nodes, the job at 4 (a 2-node base, two units): base node 1's node set DOWN. Slurm takes it out of
    the base job (--no-kill) and kills its agent; the base job tells the controller at once (node_failed),
    the job trains on at 3, and a replacement job for node rank 1 starts on the free node and joins (4).
    Bit-identical to a 4-rank run."""
    r = run_slurm_elastic(SlurmElasticConfig(log_dir=str(tmp_path), steps=300, base_down=True, node_down=False, **BATCH),
                          chaos_reference_cache)
    brief = {k: r.get(k) for k in ("error", "steps", "finished_at", "world_sizes", "marks", "units", "base_state", "grow_s", "events",
                                   "state_differences", "error_tail")}
    assert r["completed"], json.dumps(brief, indent=1)
    # the unit nodes are free from the start: the base job starts the job at 2, at 3 when a unit's node was up
    # before its first step, or at 4 when both were (each seen in CI); the units may join together (2 -> 4)
    turns = _turns(r["world_sizes"])
    assert turns[:-3] in ([], [2], [3]) and turns[-3:] == [4, 3, 4], brief
    assert r["lost_steps"] == 0 and r["bitwise_equal"] and _ended_at_run_time(r), brief
    shrink = next(e for e in r["events"] if e["to"] < e["from"])
    # told by the scheduler, not found out a heartbeat timeout (30 s) later
    assert shrink["gap_s"] < 10, shrink
    # the 3 -> 4 above is the replacement job for node rank 1 joining (its state when the job ended, after
    # the base job cancelled it, is whatever squeue still says: RUNNING, COMPLETED or CANCELLED)
    assert any(name.endswith("-u1") for name, _ in r["units"].values()), brief


def test_timings_read_the_notice_and_the_first_commit_at_the_new_size():
    commits = [(10.0, 0, 2), (11.0, 1, 4), (12.0, 2, 4), (13.5, 3, 2), (14.0, 4, 2), (20.0, 5, 4)]
    decisions = [{"t": 9.0, "decision": "preempt"}, {"t": 12.5, "decision": "preempt"}]
    marks = [{"kind": "capacity", "t": 10.5}, {"kind": "preemptor_submitted", "t": 12.2},
             {"kind": "capacity", "t": 18.0}]
    assert timings(commits, decisions, marks, 2, 4) == {"shrink_s": [1.0], "grow_s": [0.5, 2.0]}
    # no notice after the preemptor (the job was never told): no figure, not a made-up one
    assert timings(commits, decisions[:1], marks[1:2], 2, 4) == {"shrink_s": [], "grow_s": []}


def test_bench_elastic_slurm_bad_input_is_one_line():
    import subprocess
    import sys

    for argv, message in ((["--cycles", "0"], "--cycles must be >= 1"),
                          (["--global-batch", "10", "--micro-batch", "4"], "must be a multiple of --micro-batch")):
        done = subprocess.run([sys.executable, "-m", "hp.core.cli", "bench", "elastic", "--scheduler", "slurm", *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_bench_table_shows_medians_and_ranges_and_a_missing_figure_as_such():
    from hp.chaos.bench.elastic_slurm import format_table
    from hp.chaos.bench.meta import spread

    result = {"spread": {"shrink_s": spread([0.2, 0.25, 0.21]), "grow_s": spread([6.0, 6.5]),
                         "baseline_shrink_s": spread([8.9]), "baseline_grow_s": spread([])},
              "hp": {"world_sizes": [1, 2, 1, 2], "lost_steps": 0}, "baseline": {"lost_steps": 0}}
    table = format_table(result)
    assert "0.210" in table and "[0.200-0.250]" in table and "[6.000-6.500]" in table and "8.900" in table
    assert table.splitlines()[3].rstrip().endswith("-")  # no torchrun grow measured: a dash, not a number

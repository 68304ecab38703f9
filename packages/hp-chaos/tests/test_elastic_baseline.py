"""The elastic baseline of ``hp bench elastic``: torchrun (c10d rendezvous, ``--nnodes MIN:MAX``) + DCP
checkpoint-restart driven through scale events by real processes, and its pause arithmetic on
hand-made logs."""

from __future__ import annotations

import json

import pytest
from hp.chaos.baselines.elastic_torchrun import (
    TAG_VAR,
    ElasticBaselineConfig,
    ScaleEvent,
    _Logs,
    analyse,
    format_table,
    parse_events,
    run_baseline,
)
from hp.testing import kill_tagged, tagged_pids




@pytest.mark.slow
@pytest.mark.timeout(420)  # a hang guard for a loaded 2-core box; the run itself takes ~1 min
def test_torchrun_elastic_baseline_goes_through_a_kill_and_a_grow(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()
    tag = f"HP_TEST_DIR={tmp_path}"
    monkeypatch.setenv("HP_DATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HP_TEST_DIR", str(tmp_path))  # inherited by every agent and worker
    cfg = ElasticBaselineConfig(nodes=2, events="kill@7,grow@+3", steps=120, global_batch=48, micro_batch=8,
                                ckpt_every=5, corpus_mb=2, log_dir=str(tmp_path / "logs"), timeout_s=360)
    try:
        r = run_baseline(cfg)
        left = tagged_pids(tag)  # no agent or worker may outlive the run
    finally:
        kill_tagged(tag)
    assert r["completed"], format_table(r) + "\n" + json.dumps(r.get("error_tail"))[-4000:]
    assert left == []
    json.dumps(r)  # the result is plain JSON
    assert r["nnodes"] == [2, 3] and r["reached_end"] and r["final_step"] == 119
    assert [a["returncode"] for a in r["agents"]] == [0, 0, 0]
    kill, grow = r["events"]
    assert (kill["kind"], grow["kind"]) == ("kill", "grow")
    # the kill restarts every worker at the same size from the checkpoint of step 5 (step 7 or 8 was
    # reached): those steps are computed twice
    assert (kill["world_before"], kill["world_after"], kill["world_settled"]) == (2, 2, 2)
    assert kill["restored_step"] == 5 and kill["first_step_after"] == 6 and kill["lost_steps"] >= 2
    assert kill["step_before"] >= 7
    # the grow re-forms at 3 after a graceful stop: every rank saved the step it finished, none is lost
    assert (grow["world_before"], grow["world_after"]) == (2, 3) and grow["world_as_expected"]
    assert grow["lost_steps"] == 0 and grow["restored_step"] == grow["step_before"]
    for e in (kill, grow):
        assert e["pause_s"] > 0 and e["downtime_s"] >= e["pause_s"] - 1e-9 and e["rounds"] >= 1
        assert e["first_commit_after_s"] > e["last_commit_before_s"]
        assert set(e["phases"]) >= {"detect_teardown", "import", "dcp_load", "first_step"}
    assert r["median"]["pause_s"] == pytest.approx((kill["pause_s"] + grow["pause_s"]) / 2)
    assert set(r["step_time_s"]) == {"2", "3"} and r["ckpt_save_s"] > 0
    assert "kill" in format_table(r) and "2 -> 3" in format_table(r)
    with open(tmp_path / "logs" / "harness.jsonl") as f:
        assert [json.loads(line)["kind"] for line in f] == ["kill", "grow"]


# ---------------------------------------------------------------- no processes: plan, config, arithmetic
def test_parse_events_absolute_and_relative():
    assert parse_events("kill@10, grow@+5,preempt@+3") == (
        ScaleEvent("kill", 10), ScaleEvent("grow", 5, True), ScaleEvent("preempt", 3, True))
    assert ScaleEvent("grow", 5, True).due(12) == 17 and ScaleEvent("kill", 10).due(12) == 10
    for bad in ("shrink@3", "kill", "kill@x", "grow@+3", "kill@10,grow@5"):
        with pytest.raises(ValueError):
            parse_events(bad)


def test_config_derives_nnodes_and_rejects_impossible_plans():
    cfg = ElasticBaselineConfig(nodes=2, events="kill@10,grow@+10,preempt@+10,grow@+10")
    assert cfg.node_counts() == [2, 2, 3, 2, 3] and cfg.nnodes == (2, 3)
    cfg.validate()
    assert "--no-save-on-sigterm" in ElasticBaselineConfig(save_on_sigterm=False).train_args("/x")
    for bad in (dict(nodes=1, events="preempt@5"),  # only agent 0, the store host, is left to preempt
                dict(global_batch=24, micro_batch=5),
                dict(global_batch=8, micro_batch=4),  # world 3 > 2 micro-batches
                dict(events="kill@300"),
                dict(min_nodes=3),
                dict(kill_rank=2)):
        with pytest.raises(ValueError):
            ElasticBaselineConfig(**bad).validate()


def _commit(pid: int, step: int, t: float, world: int) -> dict:
    return {"event": "commit", "pid": pid, "rank": 0, "world": world, "step": step, "t": t, "loss": "0x1p+0"}


def test_analyse_pause_lost_steps_and_world_sizes_from_timestamps():
    ev = [{"event": "started", "pid": 100, "rank": 0, "at": 0.0, "t": 0.1}]
    ev += [_commit(100, s, 1.0 + 0.1 * s, 2) for s in range(11)]  # steps 0..10 until t=2.0
    # kill at t=2.05: rank 0 restarts at 4.0, loads step 5, recomputes 6..10 and goes on
    ev += [{"event": "started", "pid": 200, "rank": 0, "at": 4.0, "t": 4.1},
           {"event": "imported", "pid": 200, "rank": 0, "t": 5.0},
           {"event": "restored", "pid": 200, "rank": 0, "step": 5, "t": 5.8}]
    ev += [_commit(200, s, 6.0 + 0.1 * (s - 6), 2) for s in range(6, 21)]  # until t=7.4
    # grow at t=7.0: the old world trains on to step 20; rank 0 of world 3 restarts at 8.0
    ev += [{"event": "started", "pid": 300, "rank": 0, "at": 8.0, "t": 8.1},
           {"event": "restored", "pid": 300, "rank": 0, "step": 20, "t": 9.5}]
    ev += [_commit(300, s, 10.0 + 0.2 * (s - 21), 3) for s in range(21, 30)]
    ev.append({"event": "checkpoint_saved", "pid": 300, "rank": 0, "duration_s": 0.05, "why": "sigterm", "t": 9.0})
    fired = [{"t": 2.05, "kind": "kill", "pid": 101, "rank": 1, "at_step": 10},
             {"t": 7.0, "kind": "grow", "agent": 2, "agent_pid": 999, "at_step": 16}]
    r = analyse(sorted(ev, key=lambda e: e["t"]), fired, steps=30)
    kill, grow = r["events"]
    assert kill["pause_s"] == pytest.approx(6.0 - 2.0 - 0.1)
    assert kill["lost_steps"] == 5 and kill["restored_step"] == 5 and kill["step_before"] == 10
    assert kill["downtime_s"] == pytest.approx(6.5 - 2.0 - 0.1)  # step 11 again: recomputation included
    assert kill["phases"]["detect_teardown"] == pytest.approx(2.0) and kill["phases"]["import"] == pytest.approx(1.0)
    assert (kill["world_before"], kill["world_after"], kill["world_as_expected"]) == (2, 2, True)
    assert grow["pause_s"] == pytest.approx(10.0 - 7.4 - 0.2)  # step time at the new world size
    assert grow["lost_steps"] == 0 and grow["last_commit_before_s"] == pytest.approx(0.4)
    assert (grow["world_before"], grow["world_after"], grow["world_expected"], grow["rounds"]) == (2, 3, 3, 1)
    assert r["step_time_s"] == {"2": pytest.approx(0.1), "3": pytest.approx(0.2)}
    assert r["median"]["lost_steps"] == 2.5 and r["reached_end"] and r["sigterm_saves"] == 1


def test_analyse_reports_an_event_the_job_never_resumed_from():
    ev = [{"event": "started", "pid": 1, "rank": 0, "at": 0.0, "t": 0.0}, _commit(1, 0, 1.0, 2), _commit(1, 1, 1.1, 2)]
    r = analyse(ev, [{"t": 2.0, "kind": "grow", "at_step": 1}], steps=10)
    assert r["events"][0]["error"] == "no commit after it" and r["median"]["pause_s"] is None
    assert not r["reached_end"]


def test_logs_reader_takes_complete_lines_only(tmp_path):
    logs = _Logs(str(tmp_path))
    path = tmp_path / "rank0-w2-1.jsonl"
    first = json.dumps({"event": "started", "pid": 1, "rank": 0, "at": 0.5, "t": 1.0})
    commit = json.dumps(_commit(1, 0, 2.0, 2))
    path.write_text(first + "\n" + commit[:10])
    assert [e["event"] for e in logs.poll()] == ["started"] and logs.started == {1: 0.5}
    path.write_text(first + "\n" + commit + "\n")
    assert [e["event"] for e in logs.poll()] == ["commit"] and logs.commits[0]["step"] == 0
    assert logs.poll() == []


def test_agents_are_tagged_for_cleanup():
    from hp.chaos.baselines.elastic_torchrun import _Job

    job = _Job(ElasticBaselineConfig(), "/tmp/x", "run-1", 1234)
    env, cmd = job.env(), job.command(is_host=False)
    assert env[TAG_VAR] == "run-1" and env["OMP_NUM_THREADS"] == "1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    conf = cmd[cmd.index("--rdzv-conf") + 1]
    assert "is_host=false" in conf and "last_call_timeout=1" in conf and "keep_alive_max_attempt=5" in conf
    assert cmd[cmd.index("--nnodes") + 1] == "2:3" and cmd[cmd.index("--rdzv-backend") + 1] == "c10d"

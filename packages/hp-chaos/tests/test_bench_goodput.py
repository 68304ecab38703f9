"""Spare replenishment (`hp run --replenish-spares`) and `hp bench goodput`, with real jobs."""

from __future__ import annotations

import json
import os
import subprocess

from hp.checkpointless.demo.run import DemoConfig, RunResult, job_command
from hp.checkpointless.events import read_events
from hp.core.testing import HP, kill_tagged


def test_replenished_spares_take_two_successive_kills_with_one_spare(tmp_path):
    (tmp_path / "cache").mkdir()
    env = {**os.environ, "HP_DATA_CACHE_DIR": str(tmp_path / "cache"), "HP_TEST_DIR": str(tmp_path),
           "HP_FAULTS": json.dumps([{"at_step": 3, "phase": "forward", "kind": "kill", "rank": 1},
                                    {"at_step": 9, "phase": "allreduce", "kind": "kill", "rank": 0}])}
    cmd = job_command(DemoConfig(nproc=2, spares=1, steps=14, corpus_mb=2, hang_timeout_s=20.0), str(tmp_path / "logs"))
    at = cmd.index("run") + 1
    cmd[at:at] = ["--replenish-spares"]  # no --max-restarts: a kill not taken by a spare stops the job
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    finally:
        kill_tagged(f"HP_TEST_DIR={tmp_path}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    decisions = [json.loads(line) for line in (tmp_path / "logs" / "controller_decisions.jsonl").read_text().splitlines()]
    promoted = [(d["rank"], d["spare"]) for d in decisions if d["decision"] == "promote_spare"]
    assert promoted == [(1, "n0s0"), (0, "n0s1")]  # the second kill went to the replacement spare
    assert [d["spare"] for d in decisions if d["decision"] == "spare_added"] == ["n0s1", "n0s2"]
    assert not [d for d in decisions if d["decision"] in ("restart_worker", "fail_job")]
    result = RunResult(0, 0.0, read_events(str(tmp_path / "logs" / "events")), "")
    assert sorted(result.losses()) == list(range(14))
    assert all(len(v) == 1 for v in result.losses().values())  # nothing committed twice
    assert "started spare n0s1" in out.stderr


def test_bench_goodput_reports_goodput_against_the_same_run_s_baseline(tmp_path):
    (tmp_path / "cache").mkdir()
    env = {**os.environ, "HP_DATA_CACHE_DIR": str(tmp_path / "cache"), "HP_TEST_DIR": str(tmp_path)}
    try:
        # seed 4 kills rank 0 at 10 s, then rank 1 at 20 s
        out = subprocess.run(
            [*HP, "bench", "goodput", "--json", "--duration", "30", "--fault-every", "10", "--baseline", "6",
             "--nproc", "2", "--spares", "1", "--corpus-mb", "2", "--seed", "4", "--log-dir", str(tmp_path / "logs")],
            env=env, capture_output=True, text=True, timeout=280)
    finally:
        kill_tagged(f"HP_TEST_DIR={tmp_path}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["faults"], r["recoveries"], r["lost_steps"], r["restarts"]) == (2, 2, 0, 0), r
    assert r["promotions"] == 2 and r["spares_added"] == 2
    assert "killed rank 0" in out.stderr and "killed rank 1" in out.stderr
    assert r["bitwise_equal"] is True and r["bitwise_equal_steps"] > 0
    assert r["baseline"]["step_time_s"] > 0 and r["steps_committed"] > 0
    assert 0 < r["goodput"] < 1.1 and r["goodput_vs_baseline"] > 0  # the numbers themselves are the output
    assert "goodput" in out.stdout and "recoveries" in out.stdout


def test_bench_goodput_bad_input_is_a_one_line_error(tmp_path):
    for args, message in [(["--fault-every", "50", "--duration", "20"], "0 < --fault-every < --duration"),
                          (["--spares", "0"], "--spares >= 1"),
                          (["--model-size", "huge"], "--model-size must be one of")]:
        out = subprocess.run([*HP, "bench", "goodput", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1

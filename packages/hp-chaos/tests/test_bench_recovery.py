"""`hp bench recovery`: the same SIGKILL recovered by hp (hot spare), by torchrun + DCP and by torchft
(where installed), with real processes; and the downtime arithmetic on a hand-made baseline event log."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from hp.chaos.baselines import torchft_bench
from hp.chaos.bench_recovery import analyse_torchrun
from hp.core.cli import main as hp_main
from hp.core.testing import HP, kill_tagged, tagged_pids




@pytest.mark.timeout(420)  # three variants, five jobs: a hang guard for a loaded 2-core box
def test_bench_recovery_hp_beats_checkpoint_restart_on_the_same_fault(tmp_path):
    (tmp_path / "cache").mkdir()
    tag = f"HP_TEST_DIR={tmp_path}"
    env = {**os.environ, "HP_DATA_CACHE_DIR": str(tmp_path / "cache"), "HP_TEST_DIR": str(tmp_path)}
    try:
        out = subprocess.run(
            [*HP, "bench", "recovery", "--json", "--model-size", "tiny", "--steps", "12", "--fault-step", "6",
             "--ckpt-every", "4", "--corpus-mb", "2", "--timeout", "120", "--log-dir", str(tmp_path / "logs")],
            env=env, capture_output=True, text=True, timeout=400, check=False)
        left = tagged_pids(tag)  # no launcher, worker, spare or Lighthouse may outlive the bench
    finally:
        kill_tagged(tag)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert left == []
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("model_size", "params", "world_size", "step_time_s", "hp", "torchrun_dcp", "torchft",
                "ratio_downtime_baseline_over_hp", "ratio_downtime_torchft_over_hp", "downtime_definition"):
        assert key in r, key
    assert (r["model_size"], r["world_size"]) == ("tiny", 4) and r["params"] > 0
    hp, base = r["hp"], r["torchrun_dcp"]
    assert hp["bitwise_equal"] is True and hp["lost_steps"] == 0
    assert set(hp["phases"]) >= {"detect", "hydrate", "replay"} and 0 < hp["recovery_s"] < hp["to_next_step_s"]
    # checkpoint after step 4 (4 % 4 == 0), killed after step 6: steps 5 and 6 are computed twice
    assert base["recomputed_steps"] == 6 - 4 and base["restored_step"] == 4 and base["ckpt_every"] == 4
    assert base["recompute_bitwise_equal"] is True
    assert set(base["breakdown"]) == {"detect_teardown", "process_start_import", "data_attach", "pg_init",
                                      "model_build", "dcp_load", "recompute", "interrupted_step"}
    # downtime = the time lost: fault -> step 7 committed, less one fault-free step of that variant
    for v in (hp, base):
        assert v["downtime_s"] == pytest.approx(v["to_next_step_s"] - v["step_time_s"]) and v["step_time_s"] > 0
    assert base["downtime_s"] > 0
    assert r["ratio_downtime_baseline_over_hp"] > 1  # no process restart, no re-import, nothing recomputed
    assert set(r["step_time_s"]) == {"hp", "torchrun_dcp", "torchft"}
    ft = r["torchft"]
    if torchft_bench.available() is None:  # setup.sh installs it: then it must have run, and run through
        assert ft["completed"] is True, ft.get("error_tail", ft)
        # survivors' next step ran at world 3; the killed group came back with (at least) step 6's state
        assert ft["world_at_step_after_fault"] == 3 and ft["restored_step"] >= 6
        assert ft["rejoin_s"] > 0 and set(ft["rejoin_phases"]) == {
            "detect_restart", "process_start_import", "data_attach", "model_build", "manager_up", "quorum_heal"}
        assert sum(ft["rejoin_phases"].values()) == pytest.approx(ft["rejoin_s"])
        assert 0 < ft["step_time_s"] < ft["to_next_step_s"]
        assert ft["downtime_s"] == pytest.approx(ft["to_next_step_s"] - ft["step_time_s"])
        # deterministic up to the fault, not after it: from step 7 on, fewer groups, fewer batches
        assert ft["equal_before_fault"] is True and ft["bitwise_equal"] is False
        assert ft["first_divergent_step"] == 7 and ft["dropped_batches"] >= 1  # step 7 averaged 3 groups
        assert ft["lighthouse"]["heartbeat_timeout_ms"] == 5000 and "heals from a live peer" in ft["how"]
        assert r["ratio_downtime_torchft_over_hp"] > 0 and r["completed"] is True
    else:
        assert "skipped" in ft and r["ratio_downtime_torchft_over_hp"] is None
    assert "fault -> step 7 done" in out.stdout and "downtime (that - step time)" in out.stdout


def _event(t: float, event: str, rank: int, attempt: int, **fields) -> dict:
    return {"t": t, "event": event, "rank": rank, "attempt": attempt, **fields}


def test_downtime_is_kill_to_interrupted_step_committed_again_less_one_step():
    events = [_event(float(s), "commit", 0, 0, step=s, loss=f"{s}") for s in range(4)]  # steps 0..3
    events += [_event(3.1, "fault_injected", 1, 0, step=3)]
    events += [_event(4.0 + i, name, r, 1, **extra) for r in (0, 1)
               for i, (name, extra) in enumerate([("started", {"at": 3.5}), ("imported", {}), ("data_attached", {}),
                                                  ("pg_ready", {}), ("model_ready", {}),
                                                  ("restored", {"step": 1})])]
    events += [_event(10.0 + s, "commit", 0, 1, step=s, loss=f"{s}") for s in (2, 3, 4)]
    r = analyse_torchrun(sorted(events, key=lambda e: e["t"]), fault_step=3)
    assert r["step_time_s"] == pytest.approx(1.0)  # attempt 0's commits, one a second
    assert r["to_next_step_s"] == pytest.approx(14.0 - 3.1) and r["recovery_s"] == pytest.approx(9.0 - 3.1)
    assert r["downtime_s"] == pytest.approx(14.0 - 3.1 - 1.0)
    assert r["recomputed_steps"] == 2 and r["restored_step"] == 1 and r["recompute_bitwise_equal"] is True
    assert r["breakdown"]["detect_teardown"] == pytest.approx(0.4)
    assert r["breakdown"]["recompute"] == pytest.approx(13.0 - 9.0)
    assert r["breakdown"]["interrupted_step"] == pytest.approx(1.0)
    assert sum(r["breakdown"].values()) == pytest.approx(r["to_next_step_s"])


@pytest.mark.parametrize("argv", [["bench"], ["bench", "recovery", "--steps", "8", "--fault-step", "7"],
                                  ["bench", "recovery", "--model-size", "huge"], ["bench", "recovery", "--nproc", "1"],
                                  ["bench", "recovery", "--torchft-heartbeat-timeout-ms", "0"]])
def test_bad_bench_arguments_are_usage_errors(argv, capsys):
    assert hp_main(argv) == 2
    assert "hp: error:" in capsys.readouterr().err

"""`hp bench recovery`: the same SIGKILL recovered by hp (hot spare) and by torchrun + DCP, with real
processes; and the downtime arithmetic on a hand-made baseline event log."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from hp.chaos.bench_recovery import analyse_torchrun
from hp.core.cli import main as hp_main
from hp.core.testing import HP, kill_tagged


def test_bench_recovery_hp_beats_checkpoint_restart_on_the_same_fault(tmp_path):
    (tmp_path / "cache").mkdir()
    tag = f"HP_TEST_DIR={tmp_path}"
    env = {**os.environ, "HP_DATA_CACHE_DIR": str(tmp_path / "cache"), "HP_TEST_DIR": str(tmp_path)}
    try:
        out = subprocess.run(
            [*HP, "bench", "recovery", "--json", "--model-size", "tiny", "--steps", "12", "--fault-step", "6",
             "--ckpt-every", "4", "--corpus-mb", "2", "--timeout", "120", "--log-dir", str(tmp_path / "logs")],
            env=env, capture_output=True, text=True, timeout=280, check=False)
    finally:
        kill_tagged(tag)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("model_size", "params", "world_size", "step_time_s", "hp", "torchrun_dcp", "torchft",
                "ratio_downtime_baseline_over_hp"):
        assert key in r, key
    assert (r["model_size"], r["world_size"]) == ("tiny", 4) and r["params"] > 0
    hp, base = r["hp"], r["torchrun_dcp"]
    assert hp["bitwise_equal"] is True and hp["lost_steps"] == 0
    assert set(hp["phases"]) >= {"detect", "hydrate", "replay"} and 0 < hp["recovery_s"] < hp["downtime_s"]
    # checkpoint after step 4 (4 % 4 == 0), killed after step 6: steps 5 and 6 are computed twice
    assert base["recomputed_steps"] == 6 - 4 and base["restored_step"] == 4 and base["ckpt_every"] == 4
    assert base["recompute_bitwise_equal"] is True
    assert set(base["breakdown"]) == {"detect_teardown", "process_start_import", "data_attach", "pg_init",
                                      "model_build", "dcp_load", "recompute", "interrupted_step"}
    assert hp["downtime_s"] > 0 and base["downtime_s"] > 0
    assert r["ratio_downtime_baseline_over_hp"] > 1  # no process restart, no re-import, nothing recomputed
    assert set(r["step_time_s"]) == {"hp", "torchrun_dcp"}
    assert "skipped" in r["torchft"] or "downtime_s" in r["torchft"]
    assert "downtime (to step 7 done)" in out.stdout


def _event(t: float, event: str, rank: int, attempt: int, **fields) -> dict:
    return {"t": t, "event": event, "rank": rank, "attempt": attempt, **fields}


def test_downtime_runs_from_the_kill_to_the_interrupted_step_committed_again():
    events = [_event(float(s), "commit", 0, 0, step=s, loss=f"{s}") for s in range(4)]  # steps 0..3
    events += [_event(3.1, "fault_injected", 1, 0, step=3)]
    events += [_event(4.0 + i, name, r, 1, **extra) for r in (0, 1)
               for i, (name, extra) in enumerate([("started", {"at": 3.5}), ("imported", {}), ("data_attached", {}),
                                                  ("pg_ready", {}), ("model_ready", {}),
                                                  ("restored", {"step": 1})])]
    events += [_event(10.0 + s, "commit", 0, 1, step=s, loss=f"{s}") for s in (2, 3, 4)]
    r = analyse_torchrun(sorted(events, key=lambda e: e["t"]), fault_step=3)
    assert r["downtime_s"] == pytest.approx(14.0 - 3.1) and r["recovery_s"] == pytest.approx(9.0 - 3.1)
    assert r["recomputed_steps"] == 2 and r["restored_step"] == 1 and r["recompute_bitwise_equal"] is True
    assert r["breakdown"]["detect_teardown"] == pytest.approx(0.4)
    assert r["breakdown"]["recompute"] == pytest.approx(13.0 - 9.0)
    assert r["breakdown"]["interrupted_step"] == pytest.approx(1.0)
    assert sum(r["breakdown"].values()) == pytest.approx(r["downtime_s"])


@pytest.mark.parametrize("argv", [["bench"], ["bench", "recovery", "--steps", "8", "--fault-step", "7"],
                                  ["bench", "recovery", "--model-size", "huge"], ["bench", "recovery", "--nproc", "1"]])
def test_bad_bench_arguments_are_usage_errors(argv, capsys):
    assert hp_main(argv) == 2
    assert "hp: error:" in capsys.readouterr().err

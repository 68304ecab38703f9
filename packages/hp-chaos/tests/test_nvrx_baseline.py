"""The NVRx variant of ``hp bench recovery``: real processes under NVIDIA's in-process restart
(``nvidia-resiliency-ext``, installed by scripts/setup.sh), a SIGKILL, the spare promoted and hydrated
by broadcast, the interrupted step replayed; at NVRx's default and at tuned monitor intervals."""

from __future__ import annotations

import inspect
import json
import math
from datetime import timedelta

import pytest
from hp.chaos.baselines import nvrx_bench
from hp.chaos.bench.recovery_common import BenchConfig
from hp.checkpointless.events import read_events
from hp.testing import kill_tagged, tagged_pids
from nvidia_resiliency_ext import inprocess


@pytest.mark.slow
@pytest.mark.timeout(240)  # a hang guard for a loaded 2-core box; each run takes ~10-25 s
@pytest.mark.parametrize("monitor", nvrx_bench.MONITORS)
def test_nvrx_promotes_the_spare_hydrates_it_and_replays_the_step(monitor, tmp_path, monkeypatch):
    assert nvrx_bench.available() is None  # the extra is part of the dev setup: never a skip
    (tmp_path / "cache").mkdir()
    tag = f"HP_TEST_DIR={tmp_path}"
    monkeypatch.setenv("HP_DATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HP_TEST_DIR", str(tmp_path))  # inherited by every rank and NVRx monitor daemon
    monkeypatch.setenv("HP_PIN_CORES", "1")
    cfg = BenchConfig(model_size="tiny", nproc=2, steps=8, fault_step=3, corpus_mb=2, timeout_s=180)
    try:
        r = nvrx_bench.run_nvrx(cfg, str(tmp_path / "run"), lambda msg: None, monitor)
        left = tagged_pids(tag)  # no rank and no NVRx monitor process may outlive the run
    finally:
        kill_tagged(tag)
    assert r["completed"], json.dumps(r, default=str)[-6000:]
    assert left == []
    json.dumps(r)  # the result is plain JSON
    assert r["exit_codes"] == [0, -9, 0]  # rank 1 killed itself; rank 0 and the spare finished
    assert math.isfinite(r["downtime_s"]) and 0 < r["to_next_step_s"] < 60
    assert 0 < r["recovery_s"] <= r["to_next_step_s"]
    assert set(r["phases"]) == {"detect", "abort", "restart_barrier", "pg_init", "hydrate", "replay"}
    assert sum(r["phases"].values()) == pytest.approx(r["to_next_step_s"])
    assert r["settings"]["monitor"] == monitor and r["settings"]["gloo_timeout_s"] == nvrx_bench.GLOO_TIMEOUT_S
    wrapper = r["settings"]["wrapper"]
    assert wrapper["monitor_thread_interval"] == (1.0 if monitor == "default" else nvrx_bench.TUNED_INTERVAL_S)
    # one restart: the spare (launched as rank 2) took rank 1 and was hydrated with step 3's state
    assert (r["restarts"], r["promoted_initial_rank"], r["restored_step"]) == (1, 2, 3)
    assert r["hydrate_bytes"] > 0

    events = read_events(str(tmp_path / "run" / "events"))
    commits = [e for e in events if e["event"] == "commit"]
    # every step committed by rank 0 exactly once, in order
    rank0 = [e["step"] for e in commits if e["rank"] == 0]
    assert rank0 == list(range(8)) and r["commits_per_step"] == {s: 1 for s in range(8)}
    assert sorted(r["losses"]) == list(range(8))
    # after the fault rank 1 is the promoted spare: the same all-reduced loss as the survivor, step by step
    promoted = {e["step"]: e["loss"] for e in commits if e["rank"] == 1 and e["initial_rank"] == 2}
    assert sorted(promoted) == list(range(4, 8))
    assert all(promoted[s] == r["losses"][s] for s in promoted) and r["ranks_agree_after_fault"]
    # the killed rank committed steps 0..3 only, once each
    killed = [e["step"] for e in commits if e["initial_rank"] == 1]
    assert killed == [0, 1, 2, 3]
    # the final weights, optimizer and scheduler states of both active ranks are the same bits
    finals = {e["rank"]: e["digests"] for e in events if e["event"] == "final_state"}
    assert set(finals) == {0, 1} and finals[0] == finals[1] and r["final_state_equal"]


def test_settings_default_are_nvrx_defaults_and_tuned_shortens_only_intervals():
    defaults = {name: p.default.total_seconds() for name, p in inspect.signature(inprocess.Wrapper).parameters.items()
                if isinstance(p.default, timedelta)}
    assert nvrx_bench.settings("default")["wrapper"] == defaults
    tuned = nvrx_bench.settings("tuned")["wrapper"]
    assert {k for k in tuned if tuned[k] != defaults[k]} == set(nvrx_bench.INTERVALS)
    assert all(tuned[k] == nvrx_bench.TUNED_INTERVAL_S for k in nvrx_bench.INTERVALS)
    with pytest.raises(ValueError):
        nvrx_bench.settings("fast")

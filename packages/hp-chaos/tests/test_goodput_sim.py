"""``hp goodput simulate``: the simulator against closed forms, its invariants, and the CLI end to end
(a synthetic results file; exit 2 with one line for what the user got wrong)."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys

import pytest
from hp.chaos.goodput_sim import (
    STRATEGIES, Costs, ckpt_restart_expected, ckpt_restart_first_order, gpu_mttf_s, simulate, simulate_run,
    worked_example, young_daly_interval,
)
from hp.core.errors import UsageError
from hp.testing import HP

DAY = 86400.0


def _costs(**kw) -> Costs:
    base = dict(save_s=30.0, restart_s=(300.0,), hp_downtime_s=(1.0,), hp_stall_s=0.05, shrink_s=(1.0,),
                grow_s=(0.5,), reinit_s=0.0, replace_s=1800.0, spares_per_1k_gpus=1.0, gpus_per_node=8)
    return Costs(**{**base, **kw})


def _mean_sd(strategy: str, costs: Costs, job_mttf_s: float, days: float, seeds: int, gpus: int = 8,
             tau: float | None = None) -> tuple[float, float]:
    """Mean goodput over ``seeds`` histories and the standard error of that mean."""
    g = [simulate_run(strategy, gpus, job_mttf_s * gpus, costs, days * DAY, s, tau=tau)["goodput"] for s in range(seeds)]
    return statistics.fmean(g), statistics.stdev(g) / math.sqrt(seeds)


def test_worked_example_reproduces_the_published_figures():
    w = worked_example()
    assert w["cost_per_disruption_usd"] == pytest.approx(4693.33, abs=1.0)  # 256 x $55 x 20 min
    assert w["monthly_cost_usd"] == pytest.approx(140_800, abs=1.0) and round(w["monthly_cost_usd"], -3) == 141_000
    assert w["delay_h"] == pytest.approx(10.0)


def test_published_failure_figures_give_the_per_gpu_mttf():
    assert gpu_mttf_s("meta-16k") / 3600 == pytest.approx(1.8 * 16384)
    assert gpu_mttf_s("meta-1k") / 3600 == pytest.approx(7.9 * 1024)
    assert gpu_mttf_s("llama3") / 3600 / 16384 == pytest.approx(3.093, abs=1e-3)  # 54 days / 419


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_failures_goodput_is_one_minus_checkpoint_overhead_exactly(strategy):
    tau, c = 600.0, _costs(save_s=30.0, hp_stall_s=2.0)
    save = 30.0 if strategy == "ckpt_restart" else 2.0
    horizon = 1000 * (tau + save)  # a whole number of cycles
    r = simulate_run(strategy, 1024, math.inf, c, horizon, seed=3, tau=tau)
    assert r["goodput"] == pytest.approx(tau / (tau + save), rel=1e-12) and r["failures"] == 0
    # without failures Daly never checkpoints: nothing is ever lost
    assert simulate_run(strategy, 1024, math.inf, c, horizon, seed=3)["goodput"] == 1.0


def test_young_daly_interval_is_daly_higher_order_and_the_analytic_optimum():
    c, m = 30.0, 6 * 3600.0
    tau = young_daly_interval(c, m)
    x = c / (2 * m)
    assert tau == pytest.approx(math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c, rel=1e-12)
    assert tau == pytest.approx(math.sqrt(2 * c * m), rel=0.03)  # Young's, to first order
    best = ckpt_restart_expected(tau, c, 300.0, m)
    assert all(ckpt_restart_expected(tau * f, c, 300.0, m) < best for f in (0.8, 0.9, 1.1, 1.25))


def test_simulated_ckpt_restart_matches_the_closed_forms():
    """Job MTTF 6 h, C 30 s, R 300 s: 8 runs of 400 days (~1,600 failures each). Tolerance: 4 standard
    errors of the mean (measured) plus the horizon's truncation (< tau / horizon)."""
    c, m, r = 30.0, 6 * 3600.0, 300.0
    tau = young_daly_interval(c, m)
    mean, se = _mean_sd("ckpt_restart", _costs(save_s=c, restart_s=(r,)), m, days=400, seeds=8)
    tol = 4 * se + tau / (400 * DAY)
    assert tol < 0.003  # the check is able to fail
    assert mean == pytest.approx(ckpt_restart_expected(tau, c, r, m), abs=tol)
    # the first-order form drops terms of order (tau/M)^2
    assert mean == pytest.approx(ckpt_restart_first_order(tau, c, r, m), abs=tol + (tau / m) ** 2)


def test_daly_interval_beats_half_and_double_in_simulation():
    c, m = 30.0, 6 * 3600.0
    costs, tau = _costs(save_s=c), young_daly_interval(c, m)
    at = {f: _mean_sd("ckpt_restart", costs, m, days=400, seeds=8, tau=tau * f) for f in (0.5, 1.0, 2.0)}
    for f in (0.5, 2.0):
        assert at[1.0][0] - at[f][0] > 3 * math.hypot(at[1.0][1], at[f][1]), at


def test_goodput_stays_in_zero_one_for_random_inputs():
    rng = random.Random(12)
    for seed in range(40):
        costs = _costs(save_s=rng.uniform(0, 600), restart_s=tuple(rng.uniform(0, 7200) for _ in range(3)),
                       hp_downtime_s=(rng.uniform(0, 3600),), hp_stall_s=rng.uniform(0, 60),
                       shrink_s=(rng.uniform(0, 600),), grow_s=(rng.uniform(0, 600),), reinit_s=rng.uniform(0, 120),
                       replace_s=rng.uniform(0, 86400), spares_per_1k_gpus=rng.choice([0, 0.5, 1, 8]))
        gpus = 2 ** rng.randint(4, 14)
        for strategy in STRATEGIES:
            g = simulate_run(strategy, gpus, rng.uniform(600, 1e7) * gpus, costs, rng.uniform(1, 20) * DAY, seed)
            assert 0.0 <= g["goodput"] <= 1.0, (seed, strategy, costs, g)


def test_larger_downtime_or_restart_means_lower_goodput():
    m = 2 * 3600.0  # job MTTF
    hp = [_mean_sd("hp", _costs(hp_downtime_s=(d,)), m, days=60, seeds=4, gpus=1024)[0] for d in (1, 60, 600)]
    assert hp[0] > hp[1] > hp[2]
    cr = [_mean_sd("ckpt_restart", _costs(restart_s=(r,)), m, days=60, seeds=4, gpus=1024)[0] for r in (10, 300, 1800)]
    assert cr[0] > cr[1] > cr[2]


def test_spares_run_out_hp_relaunches_and_elastic_shrinks():
    # no spares, nodes back after 2 h: hp relaunches at every failure, hp elastic shrinks instead and wins
    m, c = 3600.0, _costs(spares_per_1k_gpus=0, replace_s=7200.0, restart_s=(600.0,))
    hp = simulate_run("hp", 1024, m * 1024, c, 30 * DAY, seed=1)
    el = simulate_run("hp_elastic", 1024, m * 1024, c, 30 * DAY, seed=1)
    assert hp["restarts"] == hp["failures"] > 0 and hp["spare_recoveries"] == 0
    assert el["shrinks"] == el["failures"] > 0 and el["restarts"] == 0 and el["grows"] > 0
    assert el["goodput"] > hp["goodput"]
    # plenty of spares: hp never relaunches and elastic never needs to shrink (same history, same goodput)
    rich = _costs(spares_per_1k_gpus=64)
    a, b = (simulate_run(s, 1024, m * 1024, rich, 30 * DAY, seed=1) for s in ("hp", "hp_elastic"))
    assert a["restarts"] == b["shrinks"] == 0 and a["goodput"] == b["goodput"]


def test_simulate_rows_cover_16_to_16k():
    rows = simulate(_costs(), "meta-16k", days=2, seeds=2)
    assert [r["gpus"] for r in rows] == [2 ** k for k in range(4, 15)]
    assert rows[-1]["mttf_h"] == pytest.approx(1.8) and rows[-1]["spare_nodes"] == 16
    for r in rows:
        assert set(r["goodput"]) == set(STRATEGIES) and all(0 <= g <= 1 for g in r["goodput"].values())


RESULTS = {"benchmarks": {
    "recovery": {"variants": {
        "hp": {"downtime_s": {"median": 0.8, "min": 0.7, "max": 0.95, "n": 3, "values": [0.8, 0.7, 0.95]}},
        "torchrun_dcp": {"recovery_s": {"median": 6.0, "min": 5.6, "max": 6.8, "n": 3, "values": [6.0, 5.6, 6.8]}}}},
    "ckpt": {"dcp_sync_s": {"median": 5.0, "min": 4.7, "max": 5.6, "n": 3, "values": [5.0, 4.7, 5.6]},
             "hp_stall_s": {"warm": {"median": 0.05, "min": 0.04, "max": 0.07, "n": 3, "values": [0.05, 0.04, 0.07]}}},
    "elastic": {"hp": {"events": [{"kind": "shrink", "pause_s": 1.0}, {"kind": "grow", "pause_s": 0.6},
                                  {"kind": "preempt", "pause_s": 0.9}]}},
}}


def _hp(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*HP, "goodput", "simulate", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_cli_json_and_png(tmp_path):
    path, png = tmp_path / "results.json", tmp_path / "g.png"
    path.write_text(json.dumps(RESULTS))
    out = _hp("--results", str(path), "--seeds", "3", "--json", "--png", str(png))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"rows", "worked_example", "hp_worked_example", "inputs", "goodput_at_16k"} <= set(r)
    assert [row["gpus"] for row in r["rows"]] == [2 ** k for k in range(4, 15)]
    assert all(set(row["goodput"]) == {"ckpt_restart", "hp", "hp_elastic"} for row in r["rows"])
    w = r["worked_example"]
    assert w["cost_per_disruption_usd"] == pytest.approx(4693.33, abs=1) and w["delay_h"] == pytest.approx(10)
    assert w["monthly_cost_usd"] == pytest.approx(140_800, abs=1)
    assert r["hp_worked_example"]["hp"]["cost_per_disruption_usd"] < w["cost_per_disruption_usd"]
    assert all({"value", "source"} <= set(i) for i in r["inputs"].values())
    assert f"key {'benchmarks.recovery.variants.hp.downtime_s.values'}" in r["inputs"]["hp_downtime_s"]["source"]
    assert r["inputs"]["hp_downtime_s"]["value"] == pytest.approx(0.8)
    assert r["inputs"]["restart_s"]["source"].startswith("published") and r["inputs"]["restart_s_measured"]["value"] == 6
    assert r["goodput_at_16k"]["gpus"] == 16384 and 0 < r["goodput_at_16k"]["hp"] <= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and r["png"] == str(png)
    assert "published worked example" in out.stdout and "$4,693.33" in out.stdout
    # a flag overrides a measured input and says so
    flagged = _hp("--results", str(path), "--seeds", "1", "--days", "1", "--hp-downtime-s", "5", "--no-png", "--json")
    i = json.loads(flagged.stdout.strip().splitlines()[-1])["inputs"]["hp_downtime_s"]
    assert flagged.returncode == 0 and i == {"value": 5.0, "source": "flag"}


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hp: error: "), out.stderr
    return lines[0]


def test_cli_errors_are_one_line_exit_2(tmp_path):
    broken = json.loads(json.dumps(RESULTS))
    del broken["benchmarks"]["ckpt"]["hp_stall_s"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    assert "missing key benchmarks.ckpt.hp_stall_s.warm.median" in _one_line_error(_hp("--results", str(path), "--no-png"))
    assert "/nonexistent" in _one_line_error(_hp("--results", "/nonexistent", "--no-png"))
    assert "--results" in _one_line_error(_hp("--no-png", cwd=tmp_path))  # nothing to find from here upward
    assert "--seeds" in _one_line_error(_hp("--results", str(path), "--seeds", "0"))


def test_cli_finds_the_newest_results_file_upward(tmp_path):
    found = tmp_path / "benchmarks" / "results"
    found.mkdir(parents=True)
    (found / "all.json").write_text(json.dumps(RESULTS))
    (tmp_path / "sub").mkdir()
    out = _hp("--seeds", "1", "--days", "1", "--max-gpus", "64", "--no-png", "--json", cwd=tmp_path / "sub")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["config"]["results"] == str(found / "all.json") and [x["gpus"] for x in r["rows"]] == [16, 32, 64]
    assert r["goodput_at_16k"] is None and r["goodput_at_largest"]["gpus"] == 64


def test_cli_passes_over_newer_files_that_lack_what_it_needs(tmp_path):
    """#31 item 14: the newest file was a test-suite durations file ("missing key benchmarks.recovery...")."""
    import os

    found = tmp_path / "benchmarks" / "results"
    found.mkdir(parents=True)
    (found / "2026-01-01-all.json").write_text(json.dumps(RESULTS))
    (found / "2026-02-01-suite.json").write_text(json.dumps({"schema": "suite", "tests": []}))
    (found / "2026-03-01-broken.json").write_text("{not json")
    os.utime(found / "2026-01-01-all.json", (1, 1))  # the oldest of the three
    out = _hp("--seeds", "1", "--days", "1", "--max-gpus", "32", "--no-png", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["config"]["results"] == str(found / "2026-01-01-all.json")
    (found / "2026-01-01-all.json").unlink()
    assert "with every key the simulation needs" in _one_line_error(_hp("--no-png", cwd=tmp_path))


def test_png_without_matplotlib_is_a_one_line_usage_error(monkeypatch, tmp_path):
    from hp.chaos import goodput_cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(UsageError, match="pip install matplotlib") as e:
        goodput_cli.write_png({}, str(tmp_path / "x.png"))
    assert "\n" not in str(e.value)


def test_building_the_parser_imports_no_simulation():
    code = ("import sys; from hp.core.cli import build_parser; build_parser(); "
            "print('hp.chaos.goodput_sim' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr

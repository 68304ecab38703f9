"""``hp bench control``'s JSON contract, on a small run (the relay itself: hp-core's test_fanout.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_bench_control_json_contract():
    out = subprocess.run([sys.executable, "-m", "hp.core.cli", "bench", "control", "--json", "--sizes", "24,48",
                          "--repeats", "1", "--changes", "2", "--idle", "1", "--relay-wait", "0.5",
                          "--processes", "2"], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["benchmark"] == "control" and r["definition_version"] >= 1 and r["machine"]["cores"] >= 1
    assert r["ranks"] == 48 and r["mode"] == "per_node_fanout"
    fanout, poll = r["modes"]["per_node_fanout"], r["modes"]["per_rank_poll"]
    assert [row["ranks"] for row in fanout] == [row["ranks"] for row in poll] == [24, 48]
    assert r["requests_per_rank_s"] == fanout[-1]["requests_per_rank_s"]["median"]
    assert r["fanout_p99_s"] == fanout[-1]["fanout_p99_s"]["median"]
    assert fanout[-1]["fanout_p99_s"]["n"] == 2 and 0 < r["fanout_p99_s"] < 10
    # generous bounds: the relay re-reads once per 0.5 s per node of 8 ranks (0.25/s per rank); a poller
    # reads twice every 10 ms
    assert r["requests_per_rank_s"] < 2 < poll[-1]["requests_per_rank_s"]["median"]
    for mode in ("per_rank_poll", "per_node_fanout"):
        p = r["projection"][mode]
        assert p["ranks"] == 16384 and p["store_requests_s"] == pytest.approx(p["requests_per_rank_s"] * 16384)
        assert p["fanout_p99"]["at_ranks"] == 16384
    stages = r["projection"]["per_node_fanout"]["by_stage"]
    parts = stages["store_stage_s"] + stages["node_stage_p99_s"] + stages["plan_verify_s"]
    assert stages["p99_s"] == pytest.approx(parts)
    assert 0 < fanout[-1]["store_stage_s"]["median"] <= fanout[-1]["fanout_max_s"]["median"]
    assert r["projection"]["plan_verify_s"] > 0 and isinstance(r["goal"]["met"], bool)
    assert "per_node_fanout" in out.stdout  # the table comes first

"""``hp bench init``'s JSON contract on a small run (rootless, TCPStore and etcd formations, one controller
failover), and its bad input (the etcd store backend itself: hp-core's test_etcd_store.py)."""

from __future__ import annotations

import json
import subprocess

import pytest

from hp.testing import HP


@pytest.mark.timeout(180)
def test_bench_init_json_contract():
    out = subprocess.run([*HP, "bench", "init", "--json", "--ranks", "2,4", "--repeats", "1", "--no-warmup",
                          "--failover-repeats", "1", "--lease", "1"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["benchmark"] == "init" and r["completed"] is True and r["errors"] == []
    assert [row["ranks"] for row in r["rows"]] == [2, 4]
    for row in r["rows"]:
        for v in ("rootless", "tcpstore", "etcd"):
            assert row[f"{v}_s"] > 0 and row[v]["n"] == 1 and row[v]["median"] == row[f"{v}_s"]
    f = r["failover"]
    assert r["failover_s"] == f["failover"]["median"] and f["failover"]["n"] == 1 and f["state_intact"] is True
    assert 0 < r["failover_s"] < 30 and f["lease_s"] == 1
    assert r["machine"]["cores"] >= 1 and r["definition_version"] >= 1 and r["etcd"]["version"]
    assert "rootless" in out.stdout.splitlines()[1]  # the table comes first


def test_bench_init_bad_input_is_a_one_line_error():
    out = subprocess.run([*HP, "bench", "init", "--ranks", "1,4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--ranks" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
